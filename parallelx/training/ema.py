"""A moving average of a model's weights, kept beside it on every backend, as sharded as the model.

::

    model, optimizer = backend.setup(model, optimizer)
    ema = parallelx.EMA(backend, model, decay=0.999, every=1)      # after setup
    for x, y in backend.batches(loader):
        backend.backward(loss_fn(model(x), y))
        if backend.step(optimizer) is not None:
            ema.update()                                            # after each optimizer step
    with ema.swapped():                                             # evaluate with the averaged weights
        val_loss = evaluate(model)
    backend.save(ema.model_state_dict(), "ema.pt")                  # a plain state dict of the model

The arithmetic is torch's :class:`torch.optim.swa_utils.AveragedModel`'s
with :func:`~torch.optim.swa_utils.get_ema_multi_avg_fn` (or any elementwise
``multi_avg_fn`` of that signature: :func:`~torch.optim.swa_utils.get_swa_multi_avg_fn`
gives SWA): the first update copies the weights, each later one averages them
in, so the average equals, to the bit, the ``AveragedModel`` one process keeps of
the same weights.  Each rank averages only its own share of every parameter
(the strategy's :meth:`~parallelx.Strategy.parameter_shards`: the whole
parameter on single, dp, ddp, horovod and ZeRO 0-2, this rank's slice under
fsdp and ZeRO-3), so no rank ever gathers a whole copy to update it; whole
tensors are put together only by :meth:`EMA.state_dict` and
:meth:`EMA.model_state_dict` (collectives: every rank calls them).

Buffers (BatchNorm's statistics) are whole on every backend: as in
``AveragedModel``, they are copied at each update (``use_buffers=False``) or
averaged with the weights (``use_buffers=True``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from parallelx.errors import ParallelxError
from parallelx.parts.shards import ParameterShards
from parallelx.parts.stateio import plain_key
from parallelx.tensor_parallel.checkpoints import TensorParallelShards

if TYPE_CHECKING:
    from parallelx.backend import Backend

__all__ = ["EMA", "refuse_averaged_model"]

#: ``multi_avg_fn(averaged, current, n_averaged)``, as ``AveragedModel`` takes it.
MultiAvgFn = Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor], torch.Tensor], None]
#: The key of :meth:`EMA.state_dict` that ``AveragedModel`` does not have (and ignores with ``strict=False``).
STEPS_KEY = "ema_steps"
_PREFIX = "module."


class EMA:
    """An average of ``model``'s weights (a model returned by ``backend.setup``), updated every
    ``every`` calls of :meth:`update`.

    ``decay``: ``get_ema_multi_avg_fn(decay)``'s; or give ``multi_avg_fn`` (elementwise, as torch's
    EMA and SWA functions are) instead.  ``use_buffers``: average the buffers too, as
    ``AveragedModel(use_buffers=True)``; otherwise they are the model's at the last update.
    """

    def __init__(
        self,
        backend: Backend,
        model: nn.Module,
        *,
        decay: float | None = None,
        every: int = 1,
        use_buffers: bool = False,
        multi_avg_fn: MultiAvgFn | None = None,
    ) -> None:
        if isinstance(model, AveragedModel):
            raise ParallelxError(
                "parallelx.EMA takes the model itself, not a torch AveragedModel: "
                "parallelx.EMA(backend, model, multi_avg_fn=get_ema_multi_avg_fn(decay)) keeps the same average, "
                "sharded as the model is"
            )
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ParallelxError(f"EMA(every=...) must be an int >= 1, got {every!r}")
        if decay is not None and multi_avg_fn is not None:
            raise ParallelxError("EMA: give decay= or multi_avg_fn=, not both")
        if decay is not None and not 0.0 <= decay <= 1.0:
            raise ParallelxError(f"EMA(decay=...) must be in [0, 1], got {decay!r}")
        self.backend = backend
        self.model = model
        self.decay = 0.999 if decay is None and multi_avg_fn is None else decay
        self.every = every
        self.use_buffers = use_buffers
        self.avg_fn: MultiAvgFn = multi_avg_fn or get_ema_multi_avg_fn(self.decay)
        #: The model's parameters as this rank holds them (whole, or this rank's slices).
        self.shards: ParameterShards = backend.strategy.parameter_shards(model)
        if backend.tensor_parallel is not None:  # the split layers' slices whole in the average's checkpoints
            self.shards = TensorParallelShards(self.shards, backend.tensor_parallel)
        #: The average: this rank's share of each parameter, by plain name.
        self.weights: dict[str, torch.Tensor] = {n: t.clone() for n, t in self.shards.local().items()}
        #: The buffers (whole on every backend), by plain name.
        self.buffers: dict[str, torch.Tensor] = {n: b.clone() for n, b in self._live_buffers().items()}
        #: Updates made (``AveragedModel.n_averaged``) and :meth:`update` calls.
        self.n_averaged = 0
        self.steps = 0
        for observer in backend.observers:  # python -m parallelx check compares the average too
            observer.made_average(self)

    # ------------------------------------------------------------ updating
    def _live_buffers(self) -> dict[str, torch.Tensor]:
        return {plain_key(n): b.detach() for n, b in self.shards.module.named_buffers()}

    @torch.no_grad()
    def update(self) -> bool:
        """Count an optimizer step; every ``every``-th, average the model's weights in (no
        communication).  True when it averaged."""
        self.steps += 1
        if self.steps % self.every:
            return False
        live = self.shards.local()
        mine, theirs = list(self.weights.values()), [live[n] for n in self.weights]
        buffers = self._live_buffers()
        if self.use_buffers:
            mine += list(self.buffers.values())
            theirs += [buffers[n] for n in self.buffers]
        else:
            for name, b in self.buffers.items():
                b.copy_(buffers[name])
        if self.n_averaged == 0:
            for a, b in zip(mine, theirs):
                a.copy_(b)
        else:
            groups: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
            for a, b in zip(mine, theirs):
                ours, live_ones = groups.setdefault((a.device, a.dtype), ([], []))
                ours.append(a)
                live_ones.append(b.to(a.device))
            for (device, _), (ours, live_ones) in groups.items():
                self.avg_fn(ours, live_ones, torch.tensor(self.n_averaged, dtype=torch.long, device=device))
        self.n_averaged += 1
        return True

    # ------------------------------------------------------------ evaluating
    @contextlib.contextmanager
    def swapped(self) -> Iterator[nn.Module]:
        """The model with the averaged weights (and buffers) inside the block, its own after it.
        Every rank enters it: a sharded model's forward is a collective."""
        live, buffers = self.shards.local(), self._live_buffers()
        kept = {n: t.clone() for n, t in live.items()}
        kept_buffers = {n: b.clone() for n, b in buffers.items() if n in self.buffers}
        with torch.no_grad():
            for name, t in self.weights.items():
                live[name].copy_(t)
            for name, b in self.buffers.items():
                buffers[name].copy_(b)
        self.shards.written()
        try:
            yield self.model
        finally:
            with torch.no_grad():
                for name, t in kept.items():
                    live[name].copy_(t)
                for name, b in kept_buffers.items():
                    buffers[name].copy_(b)
            self.shards.written()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """A forward of the model with the averaged weights (no gradients)."""
        with self.swapped() as model, torch.no_grad():
            return model(*args, **kwargs)

    # ------------------------------------------------------------ state
    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's plain ``state_dict`` with the averaged weights and buffers, whole, on the
        CPU: what ``model.load_state_dict`` of the plain model takes.  A collective."""
        whole = self.shards.gather(self.weights)
        state = {}
        for key in self.shards.module.state_dict(keep_vars=True):  # the model's entries, in its order
            name = plain_key(key)
            if name in whole:
                state[name] = whole[name]
            elif name in self.buffers:
                state[name] = self.buffers[name].detach().to("cpu", copy=True)
        return state

    def state_dict(self) -> dict[str, Any]:
        """The average, whole, in ``AveragedModel``'s layout (``n_averaged``, ``module.<name>``)
        plus the count of :meth:`update` calls.  A collective."""
        whole = self.shards.gather(self.weights)
        state: dict[str, Any] = {"n_averaged": torch.tensor(self.n_averaged, dtype=torch.long)}
        for name, t in whole.items():
            state[_PREFIX + name] = t
        for name, b in self.buffers.items():
            state[_PREFIX + name] = b.detach().to("cpu", copy=True)
        state[STEPS_KEY] = torch.tensor(self.steps, dtype=torch.long)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load what :meth:`state_dict` gave (any backend, any world size), or a one-process
        ``AveragedModel``'s ``state_dict()`` of the same model.  Every rank calls it."""
        names = [*self.weights, *self.buffers]
        missing = [n for n in names if _PREFIX + n not in state]
        if missing or "n_averaged" not in state:
            raise ParallelxError(
                f"EMA.load_state_dict: the state holds no {missing[:3] or ['n_averaged']}: "
                "it is the average of another model"
            )
        whole = {n: state[_PREFIX + n] for n in self.weights}
        for name, part in self.shards.scatter(whole).items():
            if part.shape != self.weights[name].shape:
                raise ParallelxError(
                    f"EMA.load_state_dict: {name} has shape {tuple(whole[name].shape)}, not this model's"
                )
            self.weights[name].copy_(part)
        with torch.no_grad():
            for name, b in self.buffers.items():
                b.copy_(state[_PREFIX + name].to(b.device, b.dtype))
        self.n_averaged = int(state["n_averaged"])
        steps = state.get(STEPS_KEY)
        self.steps = int(steps) if steps is not None else self.n_averaged * self.every

    def __repr__(self) -> str:
        kind = f"decay={self.decay}" if self.decay is not None else f"multi_avg_fn={self.avg_fn!r}"
        return f"EMA({kind}, every={self.every}, n_averaged={self.n_averaged}, sharded={self.shards.sharded})"


def refuse_averaged_model(backend: Backend, obj: Any, where: str) -> None:
    """Raise where a torch ``AveragedModel`` is handed to a checkpoint while the backend shards a
    model's parameters: its copy was made from the shards (fsdp) or from ZeRO-3's emptied
    parameters, and is not the average one process keeps."""
    if not isinstance(obj, AveragedModel):
        return
    sharded = False
    for model in backend.run.models():
        with contextlib.suppress(ParallelxError):
            sharded = sharded or backend.strategy.parameter_shards(model).sharded
    if sharded:
        raise ParallelxError(
            f"{where}: a torch AveragedModel beside a model that {backend.name} shards holds a copy of "
            "the shards (or of ZeRO-3's emptied parameters), not the weights; keep the average with "
            "parallelx.EMA(backend, model, multi_avg_fn=get_ema_multi_avg_fn(decay)) instead (the same "
            "arithmetic, on each rank's shard)"
        )
