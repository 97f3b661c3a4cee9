"""``ddp``: native ``DistributedDataParallel``, one process per device.

    torchrun --nproc-per-node 2 -m recipes.cifar10 --backend ddp

NCCL on GPUs (device ``cuda:$LOCAL_RANK``), Gloo on the CPU.  Started without
a launcher, it runs as a world of one process (and says how to launch more),
which keeps ``python train.py --backend ddp`` usable for debugging.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from parallelx.backend import ProcessGroupBackend, warn


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DDPBackend(ProcessGroupBackend):
    name = "ddp"

    @classmethod
    def detect(cls, environ: Mapping[str, str], argv: Sequence[str]) -> int:
        if "TORCHELASTIC_RUN_ID" in environ:
            return 10  # torchrun
        if "RANK" in environ and "WORLD_SIZE" in environ:
            return 5  # another launcher exporting the torch.distributed variables
        return 0

    def init(self) -> None:
        if "RANK" not in os.environ:
            warn("ddp: no launcher found, running as a world of 1 process; "
                 "for N processes start with `torchrun --nproc-per-node N ...`")
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        self._local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self._device = self._pick_device()
        self._init_process_group()
        import torch.distributed as dist

        self._rank, self._world_size = dist.get_rank(), dist.get_world_size()
        self._local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", self._world_size))
        self._limit_cpu_threads(self._local_world_size)
        self._initialized = True

    def wrap_model(self, model: nn.Module) -> nn.Module:
        self._require_init()
        model = model.to(self.device)
        # DDP broadcasts rank 0's parameters and buffers at construction.
        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
