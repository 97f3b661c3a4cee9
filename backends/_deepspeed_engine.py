"""What the ``deepspeed`` backend hands out: the model and the optimizer
sides of a DeepSpeed engine, as an ``nn.Module`` and a ``torch.optim.Optimizer``.

Not a backend (the leading underscore): the registry names its modules
explicitly.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from parallelx.errors import ParallelxError
from parallelx.parts.collectives import Watch
from parallelx.parts.lockstep import ForwardLockstep
from parallelx.parts.state import keep_rng_state

from ._deepspeed_zero import forget_reduced_gradients


class DeepSpeedModel(nn.Module):
    """What ``wrap_model`` returns: the user's module (``.module``) and, once
    built, its DeepSpeed engine (``.engine``).  Calls go through the engine;
    attributes the wrapper lacks are the engine's (``model.save_checkpoint``).

    The engine is built by ``wrap_optimizer``, except under ZeRO-3, where the
    optimizer waits (``defer``) and the engine is built at the first call that
    needs it: the first forward, ``optimizer.step()`` or ``zero_grad()``, a
    checkpoint, a weight average.  ZeRO-3's optimizer allocates this rank's
    gradient partition when it is built, memory torch's optimizers take at the
    first backward; set-up then holds the parameters' partitions only, from a
    model built on the meta device.  Every rank reaches these calls in the same
    order, as every rank reaches the collectives they make."""

    def __init__(
        self,
        module: nn.Module,
        build: Callable[[DeepSpeedModel, torch.optim.Optimizer | None], None],
        watch: Watch,
        lockstep: ForwardLockstep | None = None,
    ) -> None:
        super().__init__()
        self.module = module
        # Not registered as submodules: the engine holds the same module again.
        object.__setattr__(self, "build", build)
        object.__setattr__(self, "watch", watch)
        object.__setattr__(self, "lockstep", lockstep)
        object.__setattr__(self, "_engine", None)
        object.__setattr__(self, "ds_optimizer", None)  # the engine's ZeRO (or plain) optimizer
        object.__setattr__(self, "pending", None)  # the optimizer the engine is to be built with
        object.__setattr__(self, "trains", False)  # built, or to be built, with an optimizer

    @property
    def engine(self) -> Any:
        """The engine, built now if an optimizer waits for it (None: no optimizer came and no forward ran)."""
        if self._engine is None and self.pending is not None:
            self.build_now(self.pending)
        return self._engine

    @property
    def built(self) -> bool:
        return self._engine is not None

    def defer(self, optimizer: torch.optim.Optimizer) -> None:
        object.__setattr__(self, "pending", optimizer)
        object.__setattr__(self, "trains", True)

    def build_now(self, optimizer: torch.optim.Optimizer | None) -> None:
        with keep_rng_state(), self.watch("engine build (DeepSpeed's, a collective)"):
            self.build(self, optimizer)  # as in every set-up call: the user's random numbers stay theirs
        object.__setattr__(self, "pending", None)
        if optimizer is not None:
            # Every backward accumulates, a plain loss.backward() too (ZeRO 1 and 2 would otherwise reduce
            # in it, and again at step); the reduction is the optimizer's (finish_accumulation).
            self._engine.set_gradient_accumulation_boundary(False)
            engine = self._engine
            if not engine._support_torch_style_backward and not engine.fp16_enabled():
                # ZeRO 0 has no torch-style backward hooks and refuses a loss.backward() its engine did not
                # start ("Direct calls to tensor.backward() are not supported"), which the protocol form
                # (wrap_model, loss.backward(), optimizer.step()) is.  Its own backward only adds the
                # boundary's all-reduce, which parallelx runs at step (finish_accumulation), and the loss
                # scaling, which float16 alone needs (there DeepSpeed's refusal stays, and says why).
                engine._running_engine_backward_count += 1
                engine._running_engine_backward = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.lockstep is not None:  # before a build, which waits for every rank in DeepSpeed's own collectives
            self.lockstep.check(self.training)
        if self._engine is None:
            self.build_now(self.pending)  # None: no optimizer came, an engine for inference
        with self.watch("forward (ZeRO-3 gathers parameters in it)"):
            return self._engine(*args, **kwargs)

    def train(self, mode: bool = True) -> DeepSpeedModel:
        super().train(mode)
        if self._engine is not None:
            self._engine.train(mode)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        if self._engine is not None and self.trains:
            # and what ZeRO 2 and 3 reduced apart from param.grad (DeepSpeedOptimizer.zero_grad)
            self._engine.optimizer.zero_grad(set_to_none=True)
            forget_reduced_gradients(self._engine.optimizer)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            # Not for its own properties: one that raised inside (a failed build) is not retried here.
            own = name.startswith("_") or name in ("engine", "built")
            if own or (self.__dict__.get("_engine") is None and self.__dict__.get("pending") is None):
                raise
            return getattr(self.engine, name)


class DeepSpeedOptimizer(torch.optim.Optimizer):
    """The optimizer side of a DeepSpeed engine, as a ``torch.optim.Optimizer``.

    ``step()`` runs ``engine.step()`` (gradient reduction at the boundary,
    the ZeRO update, the engine's step counters); ``zero_grad()`` clears the
    engine's gradients.  ``param_groups``, ``state`` and ``defaults`` are the
    engine's optimizer's, so an LR scheduler's changes reach the update.
    """

    # Optimizer.__init__ is not called: it would build param groups of its own,
    # and these must be the very ones DeepSpeed's optimizer steps with.
    def __init__(
        self, model: DeepSpeedModel, optimizer: torch.optim.Optimizer, params: list[nn.Parameter] | None = None
    ) -> None:
        #: The model whose engine this optimizer steps (built by the first call that needs it).
        self.model = model
        #: The user's optimizer: DeepSpeed's steps it on its partitions, with these same groups and state.
        self.given = optimizer
        #: The trained parameters in the user's groups' order (ZeRO replaces
        #: them in ``param_groups`` by its flat partitions): the order in which
        #: the clipping norm adds them up, as torch's does.
        self.trained_params: list[nn.Parameter] = list(params or [])
        #: The gradients since the last step are reduced (finish_accumulation ran).
        self.reduced = False
        # torch.optim.Optimizer has no public way to make its hook registries
        # without building parameter groups of its own (its __init__ does both):
        # they are made here, so that register_step_post_hook and the others work.
        self._optimizer_step_pre_hooks = collections.OrderedDict()
        self._optimizer_step_post_hooks = collections.OrderedDict()
        self._optimizer_state_dict_pre_hooks = collections.OrderedDict()
        self._optimizer_state_dict_post_hooks = collections.OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = collections.OrderedDict()
        self._optimizer_load_state_dict_post_hooks = collections.OrderedDict()

    @property
    def engine(self) -> Any:
        return self.model.engine

    @property
    def optimizer(self) -> Any:
        """The engine's optimizer (ZeRO's, or DeepSpeed's wrapper of the user's)."""
        self.model.engine  # noqa: B018  # built if it waits
        return self.model.ds_optimizer

    @property
    def _groups_owner(self) -> Any:
        # Before the build the groups and the state are the user's optimizer's, the very objects
        # DeepSpeed's optimizer then keeps (ZeRO swaps only each group's "params"): a scheduler
        # built now, or an lr read on one rank, needs no engine.
        return self.model.ds_optimizer if self.model.built else self.given

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._groups_owner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._groups_owner.param_groups = value

    @property
    def state(self) -> Any:
        return self._groups_owner.state

    @state.setter
    def state(self, value: Any) -> None:
        self._groups_owner.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return getattr(self._groups_owner, "defaults", {})

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._groups_owner.defaults = value

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ParallelxError(
                "deepspeed: optimizer.step(closure) is not supported; DeepSpeed steps after backend.backward(loss)"
            )
        self.finish_accumulation()
        # torch.optim's step pre-hooks, once the gradients are the averaged ones the update uses
        # (as on every backend: python -m parallelx check reads them there).
        for pre_hook in list(self._optimizer_step_pre_hooks.values()):
            pre_hook(self, (), {})
        self.engine.step()
        self.engine.set_gradient_accumulation_boundary(False)  # the next backward accumulates (build_now)
        self.reduced = False
        for hook in list(
            self._optimizer_step_post_hooks.values()
        ):  # torch.optim's step hooks (parallelx.transforms.buffers)
            hook(self, (), {})

    def finish_accumulation(self) -> None:
        """The accumulation boundary, once per step: every backward accumulated (the engine's
        boundary off, whatever the number of backward calls); ZeRO 0 and 1 now all-reduce
        (reduce-scatter) the summed gradients, ZeRO 2 and 3 finish the partitions each backward
        reduced into, as DeepSpeed's ``managed_gradient_accumulation: false`` does in its step."""
        if self.reduced:
            return
        engine = self.engine
        engine.set_gradient_accumulation_boundary(True)
        if engine.zero_optimization_partition_gradients():
            engine.optimizer.finalize_gradient_accumulation_boundary()
        else:
            engine.allreduce_gradients()
        self.reduced = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad()
        # ZeRO 2 and 3 keep what the backward passes since the last step reduced in their own
        # buffers (a loss through this model's parameters that trained another model), which the
        # engine's zero_grad() does not clear: the ZeRO optimizer's zero_grad() (as engine.step
        # calls it) and, under ZeRO 2, its sums of the reduced partitions.
        self.optimizer.zero_grad(set_to_none=True)
        forget_reduced_gradients(self.optimizer)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise ParallelxError(
            "deepspeed: parameter groups cannot be added after the engine is built; "
            "give every group to the optimizer before wrap_optimizer"
        )

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"DeepSpeedOptimizer({type(self._groups_owner).__name__})"

    def __getattr__(self, name: str) -> Any:
        model = self.__dict__.get("model")
        # Not torch's probes of its own attributes (_opt_called), nor a property of this class that
        # raised inside (a failed build): those build nothing here.
        if (
            model is None
            or name.startswith("_")
            or name in ("engine", "optimizer", "param_groups", "state", "defaults")
        ):
            raise AttributeError(name)
        return getattr(self.optimizer, name)


def graph_parameters(loss: torch.Tensor) -> set[int]:
    """ids of the leaf tensors (parameters) that ``loss``'s autograd graph reaches."""
    found: set[int] = set()
    seen: set[int] = set()
    stack = [loss.grad_fn] if loss.grad_fn is not None else []
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        var = getattr(fn, "variable", None)  # AccumulateGrad nodes hold their leaf
        if var is not None:
            found.add(id(var))
        stack.extend(next_fn for next_fn, _ in fn.next_functions if next_fn is not None)
    return found
