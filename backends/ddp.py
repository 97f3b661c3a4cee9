"""``ddp``: native ``DistributedDataParallel``, one process per device.

    torchrun --nproc-per-node 2 -m recipes.cifar10 --backend ddp

NCCL on GPUs (device ``cuda:$LOCAL_RANK``), Gloo on the CPU.  Gradients are
averaged over the ranks, so with equal per-rank batches the update is that of
one process on the global batch.  Started without a launcher, it runs as a
world of one process (and says how to launch more), which keeps
``python train.py --backend ddp`` usable for debugging.  ``bf16-compute``: each
forward and backward runs on a bfloat16 copy of the weights, DDP averages the
float32 gradients (``backends/_compute_copy.py``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from parallelx.bigmodels.estimate import ModelCounts, RankMemory, Training, layout
from parallelx.launching.launchers import Launcher
from parallelx.parts.gradsync import GradientSync, Models
from parallelx.strategies.process_group import ProcessGroupStrategy
from parallelx.strategy import BackendSpec

from ._compute_copy import compute_copy
from ._moe import refuse_expert_layers

TORCHRUN = Launcher(
    name="torchrun",
    module="torchrun --nproc-per-node {n} {opts} -m {module}",
    file="torchrun --nproc-per-node {n} {opts} {file}",
    local_opts="--master-addr 127.0.0.1 --master-port {port}",
    local_env={"GLOO_SOCKET_IFNAME": "lo"},
)


class DDPSync(GradientSync):
    """DDP averages in its autograd hooks; inside a window its ``no_sync`` keeps gradients local."""

    def __init__(self, models: Models, wrapped: list[DistributedDataParallel]) -> None:
        super().__init__(models)
        self.wrapped = wrapped

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        # DDP decides in the forward whether the backward all-reduces: no_sync
        # must be entered before the forward, which Backend.batches does.
        stack = contextlib.ExitStack()
        for model in self.wrapped:
            stack.enter_context(model.no_sync())
        return stack


class DDPStrategy(ProcessGroupStrategy):
    spec = BackendSpec(
        name="ddp",
        summary="`DistributedDataParallel`; NCCL on GPUs, Gloo on the CPU",
        launcher=TORCHRUN,
        probe_code=(
            "import torch, torch.distributed as d; print('torch.distributed:', "
            "'nccl' if torch.cuda.is_available() and d.is_nccl_available() else 'gloo', "
            "'(gloo available)' if d.is_gloo_available() else '(no gloo)')"
        ),
        # Every environment that gives a torch.distributed rendezvous, and none (a world of one).
        environments=("ray", "torchrun", "deepspeed", "slurm", "env", "local"),
        tensor_parallel=True,
    )

    def __init__(self) -> None:
        self.wrapped: list[DistributedDataParallel] = []

    @classmethod
    def estimate_memory(cls, model: ModelCounts, world_size: int, training: Training) -> list[RankMemory]:
        # DDP copies the gradients into flat buckets of its own (C++-held, as large as the gradients) to
        # all-reduce them, and broadcasts rank 0's weights at construction through a flat copy of up to
        # 250 MiB (torch's broadcast_bucket_size).
        return [
            layout(
                cls.spec.name,
                model,
                world_size,
                training,
                extra=model.trainable_bytes,
                why="gradient buckets",
                setup=model.state_bytes + min(model.state_bytes, 250 * 2**20),
            )
        ]

    def gradient_sync(self) -> GradientSync:
        return DDPSync(self.run.models, self.wrapped)

    def wrap_model(self, model: nn.Module) -> nn.Module:
        refuse_expert_layers(model, self.name)
        device = self.run.device
        model = model.to(device)
        if not any(p.requires_grad for p in model.parameters()):
            # A frozen model (a teacher, a reference network) has no gradient to average, and DDP refuses it
            # ("DistributedDataParallel is not needed ..."): rank 0's weights and buffers, as DDP would broadcast.
            mesh = self.run.mesh
            group = mesh.dp_group if mesh is not None and mesh.tensor_parallel else None  # each keeps its slices
            if self.run.world.world_size > 1:
                for tensor in model.state_dict().values():
                    dist.broadcast(tensor.data, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
            return model
        # bf16-compute: the forward and backward on a bfloat16 copy; DDP averages the float32 gradients.
        compute_copy(model, lambda: self.run.options.compute_dtype, self.name, self.run.activation_checkpointing)
        # DDP broadcasts rank 0's parameters and buffers at construction.
        ids = [device.index] if device.type == "cuda" else None
        # Under --tensor-parallel: over the data-parallel ranks only (each holds its slices of the split layers).
        wrapped = DistributedDataParallel(
            model, device_ids=ids, process_group=self.run.mesh.dp_group if self.run.mesh else None
        )
        # Gradients cast to the wire type, divided by the world size, summed, cast back.
        hook = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}.get(
            self.run.options.grad_compression
        )
        if hook is not None:
            wrapped.register_comm_hook(None, hook)
        self.wrapped.append(wrapped)
        return wrapped
