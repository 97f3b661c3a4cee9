"""``dp``: ``torch.nn.DataParallel`` over all visible GPUs, in one process.

    python -m recipes.dogcat --backend dp

DataParallel splits each batch across the GPUs and gathers the outputs on
``cuda:0``; the loss is computed on the whole batch, so the update is that of
a single device.  Two things differ, both inherent to DataParallel and said
once when the model has BatchNorm: each GPU normalises with the statistics of
its slice of the batch, and only ``cuda:0``'s running statistics are kept.
With fewer than two GPUs (or ``device="cpu"``) it runs exactly like ``single``.
"""

from __future__ import annotations

import torch
from torch import nn

from parallelx.errors import ParallelxError
from parallelx.log import warn
from parallelx.strategies.single_process import SingleProcessStrategy
from parallelx.strategy import BackendSpec, Joined
from parallelx.utils import has_batchnorm

from ._compute_copy import compute_copy
from ._moe import refuse_expert_layers


class DataParallelStrategy(SingleProcessStrategy):
    spec = BackendSpec(
        name="dp",
        summary="`nn.DataParallel` over all visible GPUs, in one process",
        probe_code=(
            "import torch; n = torch.cuda.device_count() if torch.cuda.is_available() else 0; "
            "print(f'DataParallel over {n} GPU(s)' if n > 1 else 'fewer than 2 GPUs: runs as single')"
        ),
    )
    gpus = 0

    def join(self) -> Joined:
        device = self.run.pick_device(0)
        self.gpus = torch.cuda.device_count() if device.type == "cuda" else 0
        if self.gpus < 2 and self.run.verbose:
            where = (
                "1 GPU is"
                if self.gpus == 1
                else ("the CPU was asked for" if self.run.device_request == "cpu" else "no GPU is")
            )
            warn(f"dp: {where} in use, so DataParallel has nothing to split over; running as 'single'")
        return self.world_of_one(device)

    def wrap_model(self, model: nn.Module) -> nn.Module:
        refuse_expert_layers(model, self.name)
        model = model.to(self.run.device)
        if self.gpus < 2:
            compute_copy(model, lambda: self.run.options.compute_dtype, self.name, self.run.activation_checkpointing)
            return model
        if self.run.options.compute_dtype is not None:
            # DataParallel's replicas run the forward in threads, each on the module's hooks.
            raise ParallelxError(
                f"dp: --precision bf16-compute over {self.gpus} GPUs is not offered (DataParallel's replicas "
                "would share the bfloat16 copy's hooks across threads); use ddp (torchrun --nproc-per-node "
                f"{self.gpus} ... --backend ddp), whose bf16-compute averages float32 gradients, or bf16-mixed here"
            )
        if has_batchnorm(model):
            warn(
                "dp: DataParallel normalises each GPU's slice of the batch with that slice's statistics "
                "and keeps cuda:0's running statistics only; BatchNorm layers do not compute what one device does"
            )
        return nn.DataParallel(model)

    def sync_batchnorm(self, model: nn.Module) -> nn.Module:
        if self.gpus < 2:
            return model  # one device: the statistics are the whole batch's already
        raise ParallelxError(
            f"dp: DataParallel cannot synchronise BatchNorm across its {self.gpus} GPUs (each "
            "replica normalises its slice); use ddp (torchrun --nproc-per-node N ... --backend "
            "ddp), whose sync_batchnorm does"
        )
