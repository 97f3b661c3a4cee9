"""The package version, in a leaf module that anything may import."""

__version__ = "0.3.0"
