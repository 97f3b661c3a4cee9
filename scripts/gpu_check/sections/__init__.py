"""The check's sections, one module each: :class:`GpuCheck` has all their
steps, and ``gpu_check.cli.main`` runs them in order."""

from .environment import EnvironmentSteps
from .host_sync import HostSyncSteps
from .install import InstallSteps
from .recipes import RecipeSteps
from .throughput import ThroughputSteps


class GpuCheck(InstallSteps, EnvironmentSteps, RecipeSteps, ThroughputSteps, HostSyncSteps):
    """Every section's steps, recorded in one report."""
