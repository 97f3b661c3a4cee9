"""``horovod``: Horovod's ring all-reduce (``horovod.torch``).

    horovodrun -np 2 python -m recipes.cifar10 --backend horovod

Horovod 0.28.1 must be built against the installed torch; see
``scripts/build_horovod.py``.  The optimizer is wrapped in
``hvd.DistributedOptimizer`` (gradients averaged across ranks, as DDP does),
and rank 0's initial parameters and optimizer state are broadcast.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from parallelx.backend import Backend
from parallelx.errors import BackendUnavailableError, ParallelxError

T = TypeVar("T")
INSTALL_HINT = "build and install it with `python scripts/build_horovod.py` (Horovod 0.28.1 patched for current torch)"


class HorovodBackend(Backend):
    name = "horovod"
    requires_module = "horovod"
    install_hint = INSTALL_HINT

    @classmethod
    def detect(cls, environ: Mapping[str, str], argv: Sequence[str]) -> int:
        return 20 if "HOROVOD_RANK" in environ else 0

    def init(self) -> None:
        # Horovod reads its timeouts from the environment: the Gloo rendezvous
        # timeout, and the stall inspector, which by default only warns about a
        # rank that never joins a collective; make it shut the job down instead.
        # An explicit parallelx timeout overrides values already set.  Caveat,
        # seen with 0.28.1 on the Gloo controller: a rank that never joins was
        # not shut down by the stall inspector; a rank that *exits* is handled
        # by horovodrun, which then stops every other rank.
        timeout = max(1, int(self.timeout_s))
        for key, value in (("HOROVOD_GLOO_TIMEOUT_SECONDS", timeout),
                           ("HOROVOD_STALL_CHECK_TIME_SECONDS", min(60, timeout)),
                           ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", timeout)):
            if self.timeout_explicit or os.environ.get(key, "0") in ("", "0"):
                os.environ[key] = str(value)
        try:
            import horovod.torch as hvd
        except ImportError as exc:
            raise BackendUnavailableError(f"horovod is installed but horovod.torch does not load ({exc}); "
                                          f"it was probably built for another torch: {INSTALL_HINT}") from None
        self.hvd = hvd
        hvd.init()
        self._rank, self._world_size, self._local_rank = hvd.rank(), hvd.size(), hvd.local_rank()
        if torch.cuda.is_available() and hvd.nccl_built():
            torch.cuda.set_device(self._local_rank)
            self._device = torch.device("cuda", self._local_rank)
        self._local_world_size = hvd.local_size()
        self._limit_cpu_threads(self._local_world_size)
        self._model: nn.Module | None = None
        self._initialized = True

    def shutdown(self) -> None:
        if self._initialized:
            self.hvd.shutdown()
        super().shutdown()

    def wrap_model(self, model: nn.Module) -> nn.Module:
        self._require_init()
        model = model.to(self.device)
        self.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        self._model = model
        return model

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> Any:
        self._require_init()
        if self._model is None:
            raise ParallelxError("horovod: call wrap_model(model) before wrap_optimizer(optimizer), "
                                 "or use backend.setup(model, optimizer)")
        hvd = self.hvd
        dist_opt = hvd.DistributedOptimizer(optimizer, named_parameters=self._model.named_parameters(),
                                            op=hvd.Average)
        # hvd.broadcast_optimizer_state initialises an empty state with a
        # zero-gradient step, which weight decay turns into a real update.  A
        # fresh optimizer is empty (hence equal) on every rank, so only a
        # loaded state needs broadcasting; all ranks agree on that first.
        has_state = torch.tensor([1 if optimizer.state_dict()["state"] else 0])
        agree = self.all_reduce(has_state, op="sum").item()
        if agree not in (0, self.world_size):
            raise ParallelxError("horovod: optimizer state was loaded on some ranks but not others; "
                                 "load the checkpoint on every rank")
        if agree:
            hvd.broadcast_optimizer_state(dist_opt, root_rank=0)
        return dist_opt

    def _comm_device(self, tensor: torch.Tensor) -> torch.device:
        return self.device

    def _reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        self._require_init()
        hvd = self.hvd
        return hvd.allreduce(tensor, op={"sum": hvd.Sum, "max": hvd.Max, "min": hvd.Min}[op])

    def barrier(self) -> None:
        self._require_init()
        self.hvd.barrier()

    def broadcast(self, obj: T, src: int = 0) -> T:
        self._require_init()
        if isinstance(obj, torch.Tensor):
            return self.hvd.broadcast(obj.to(self.device), root_rank=src).to(obj.device)  # type: ignore[return-value]
        return self.hvd.broadcast_object(obj, root_rank=src)
