"""The command line of a training script: one call adds the options, one
builds the backend::

    parser = argparse.ArgumentParser()
    parallelx.add_arguments(parser)        # --backend, --device, --timeout, every backend's own
    args = parser.parse_args()
    backend = parallelx.from_args(args)    # not yet initialised: `with backend:` or backend.init()

Every backend's options are added whichever backend runs, so a script accepts
the flags a launcher appends (the deepspeed launcher's ``--local_rank``).

The script's own options win: an option string (or a dest) the parser already
has is left to the script, ``from_args`` gives the backend parallelx's default
for it and says so once; ``add_arguments(parser, prefix="px-")`` offers every
option as ``--px-backend``, ``--px-device``, ... instead.  Two kinds are left
to the script without a word: the flags a launcher appends (the deepspeed
launcher's ``--local_rank``: parallelx reads the rank from the environment),
and an option that means the same in the script's parser (:class:`SameInScripts`:
DeepSpeed's ``add_config_arguments`` adds ``--deepspeed_config``), whose value
the backend then takes.  Every on/off flag
(``--compile``, ``--cpu-offload``, ...) also takes a value: ``--compile=True``,
``--cpu-offload=no``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

from parallelx.backend import Backend
from parallelx.errors import ParallelxError
from parallelx.launching.environments import detect_environment
from parallelx.log import warn
from parallelx.observability import DEFAULT_LOG_EVERY, MonitorOptions, available_trackers, parse_loggers
from parallelx.parts.loop import COMPRESSIONS, PRECISIONS
from parallelx.registry import available_backends, backend_class, detect_backend, get_backend
from parallelx.settings import DEVICES
from parallelx.transforms.compiling import MODES

F = TypeVar("F", bound=Callable[..., int | None])


def exit_on_error(fn: F) -> F:
    """Run ``fn``; turn a :class:`ParallelxError` into its one-line message on
    stderr and exit status 2, instead of a wall of traceback.  Other
    exceptions are real bugs and keep their traceback."""

    @functools.wraps(fn)
    def wrapper(*args: object, **kwargs: object) -> int | None:
        try:
            return fn(*args, **kwargs)
        except ParallelxError as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None

    return cast(F, wrapper)


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


#: The end of the help of an option whose default is None and whose help says in
#: words what None means.  It renders as nothing; it is there because argparse's
#: ArgumentDefaultsHelpFormatter, which a script's parser may use, appends
#: "(default: None)" to every help without "%(default)" in it.
NONE_IN_WORDS = "%(default).0s"


#: The namespace attribute (a parser default, set by :func:`add_arguments`) that
#: tells :func:`from_args` where parallelx's options are in the namespace and
#: which of them were left to the script.
LAYOUT = "_parallelx"

TRUE = ("1", "true", "yes", "on", "y", "t")
FALSE = ("0", "false", "no", "off", "n", "f")


def boolean(text: str) -> bool:
    """argparse type: the value of an on/off flag given one (``--cpu-offload=yes``)."""
    word = text.strip().lower()
    if word in TRUE:
        return True
    if word in FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected one of {'/'.join(TRUE[:4])} or {'/'.join(FALSE[:4])}, got {text!r}")


def compile_value(text: str) -> bool | str:
    """argparse type of ``--compile``: a boolean, or one of ``--compile-mode``'s modes."""
    if text in MODES:
        return text
    try:
        return boolean(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected true/false/yes/no/1/0 or a mode ({', '.join(MODES)}), got {text!r}"
        ) from None


class SameInScripts(argparse.Action):
    """``action=`` of a backend's option that a script's own parser may already have with the
    same meaning (DeepSpeed's ``add_config_arguments`` adds ``--deepspeed_config``): the
    option stores its value as ``store`` does, and where the script's parser already has its
    dest, :func:`from_args` gives the backend the script's value instead of parallelx's
    default, without a warning."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: Any = None
    ) -> None:
        setattr(namespace, self.dest, values)


class Layout(dict[str, Any]):
    """Where :func:`add_arguments` put each of parallelx's options:
    ``{"prefix": "px-", "options": {dest: {"as": dest in the namespace, or None
    when the script's own option of that name won; "flags": [...]; "default":
    ...}}}``.  A plain dict underneath (a script's ``json.dumps(vars(args))``
    still works), with a short repr (``print(args)`` stays readable)."""

    @property
    def prefix(self) -> str:
        return str(self.get("prefix", ""))

    @property
    def options(self) -> dict[str, dict[str, Any]]:
        return cast(dict[str, dict[str, Any]], self.get("options", {}))

    def skipped(self) -> dict[str, dict[str, Any]]:
        """parallelx's options left to the script, by parallelx's dest."""
        return {dest: o for dest, o in self.options.items() if o["as"] is None}

    def skipped_unsaid(self) -> dict[str, dict[str, Any]]:
        """The options left to the script that deserve a word: not the flags a launcher appends."""
        return {dest: o for dest, o in self.skipped().items() if not o.get("hidden")}

    def __repr__(self) -> str:
        left = [o["flags"][0] for o in self.skipped().values()]
        return f"<parallelx options, prefix {self.prefix!r}, left to the script: {', '.join(left) or 'none'}>"


def long_flag(flag: str) -> bool:
    return flag.startswith("--")


def default_dest(flags: tuple[str, ...]) -> str:
    """The dest argparse gives an option of these strings: its first long one's, else its first's."""
    first = next((f for f in flags if long_flag(f)), flags[0])
    return first.lstrip("-").replace("-", "_")


class Options:
    """What :func:`add_arguments` hands to each helper and to each backend's
    ``add_arguments`` in place of the parser: ``add_argument``,
    ``add_argument_group`` and ``add_mutually_exclusive_group`` as argparse's,
    except that an option whose string or dest the parser already has is not
    added (the script's own option wins), the prefix goes before each option's
    name and dest, and an on/off flag (``store_true``) also takes a value.
    Anything else is the wrapped container's.  Each option is recorded in
    ``layout``; :meth:`finish` stores it on the parser."""

    def __init__(
        self,
        parser: argparse.ArgumentParser,
        prefix: str = "",
        container: Any = None,
        layout: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        self._parser = parser
        self._container = parser if container is None else container
        self._prefix = prefix
        self._layout: dict[str, dict[str, Any]] = {} if layout is None else layout

    def _child(self, container: Any) -> Options:
        return Options(self._parser, self._prefix, container, self._layout)

    def add_argument_group(self, *args: Any, **kwargs: Any) -> Options:
        return self._child(self._parser.add_argument_group(*args, **kwargs))

    def add_mutually_exclusive_group(self, **kwargs: Any) -> Options:
        return self._child(self._container.add_mutually_exclusive_group(**kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._container, name)

    def add_argument(self, *flags: str, **kwargs: Any) -> argparse.Action | None:
        if not flags or not all(f.startswith("-") for f in flags):  # a positional: the script's business
            return cast(argparse.Action, self._container.add_argument(*flags, **kwargs))
        dest = kwargs.pop("dest", None) or default_dest(flags)
        if kwargs.get("action") == "store_true":
            # --flag, and --flag=True/False/yes/no/1/0 (nanoGPT's style): a script's own spelling keeps working.
            del kwargs["action"]
            kwargs.update(nargs="?", const=True, default=kwargs.get("default", False))
            kwargs.setdefault("type", boolean)
            kwargs.setdefault("metavar", "BOOL")
        default = kwargs.get("default")
        existing = self._layout.get(dest)
        if existing is not None and existing["as"] is not None:
            return None  # added by an earlier call on this parser
        hidden = kwargs.get("help") is argparse.SUPPRESS
        dests = {a.dest for a in self._parser._actions if a.dest != argparse.SUPPRESS}
        if kwargs.get("action") is SameInScripts and dest in dests:
            # The script's own option of this dest means the same (DeepSpeed's add_config_arguments):
            # the backend reads the script's value, under any prefix.
            self._layout[dest] = {"as": dest, "flags": list(flags), "default": default}
            return None
        if self._prefix and not hidden:
            # A hidden option is one a launcher appends (deepspeed's --local_rank): it keeps its exact name.
            flags = tuple("--" + self._prefix + f.lstrip("-") for f in flags if long_flag(f))
            as_dest = self._prefix.replace("-", "_") + dest
        else:
            as_dest = dest
        taken = [f for f in flags if f in self._parser._option_string_actions]
        self._layout[dest] = {"as": None, "flags": list(flags), "default": default, "hidden": hidden}
        if taken or as_dest in dests or not flags:  # (no flags: short ones only, which take no prefix)
            # The script's own option wins; from_args gives the backend parallelx's default (a launcher's
            # flag, hidden, is read by nobody: the backend takes the rank from the environment).
            return None
        self._layout[dest]["as"] = as_dest
        return cast(argparse.Action, self._container.add_argument(*flags, dest=as_dest, **kwargs))

    def finish(self) -> None:
        """Record the layout on the parser (merged with an earlier call's)."""
        earlier = self._parser.get_default(LAYOUT)
        if isinstance(earlier, Layout):
            if earlier.prefix != self._prefix:
                raise ParallelxError(
                    f"parallelx's options were added to this parser with prefix {earlier.prefix!r}, now with "
                    f"{self._prefix!r}: add them once, with one prefix"
                )
            merged = {
                **earlier.options,
                **{
                    d: o
                    for d, o in self._layout.items()
                    if d not in earlier.options or earlier.options[d]["as"] is None
                },
            }
        else:
            merged = dict(self._layout)
        self._parser.set_defaults(**{LAYOUT: Layout(prefix=self._prefix, options=merged)})


def add_arguments(
    parser: argparse.ArgumentParser,
    default: str = "auto",
    *,
    prefix: str = "",
    title: str = "parallelx",
) -> argparse.ArgumentParser:
    """Add ``--backend``, ``--device``, ``--timeout``, the training-loop options
    (``--accumulate``, ``--clip-grad-norm``, ``--precision``,
    ``--grad-compression``), the model's (``--compile``, ...), the trackers'
    and profiles' (``--logger``, ``--profile-steps``, ...:
    :func:`add_tracking_arguments`) and every registered backend's own
    options to ``parser``; returns the parser.

    The script's own options win: one whose option string or dest ``parser``
    already has is not added, and :func:`from_args` gives the backend
    parallelx's default for it (with a warning that names it).  ``prefix``
    (e.g. ``"px-"``) puts every option under another name (``--px-backend``,
    dest ``px_backend``), so that both coexist; ``title`` is the heading of
    parallelx's first group in ``--help``.  On/off flags take a value too:
    ``--compile=True``, ``--cpu-offload=no``."""
    names = available_backends()
    options = Options(parser, prefix)
    group = options.add_argument_group(title)
    group.add_argument(
        "--backend",
        default=default,
        choices=names,
        help="distributed backend; auto follows the launcher (default: %(default)s)",
    )
    group.add_argument(
        "--device",
        default="auto",
        choices=DEVICES,
        help="auto: this process's GPU if there is one, else the CPU; cpu forces the CPU (default: %(default)s)",
    )
    group.add_argument(
        "--timeout",
        type=positive_float,
        default=None,
        metavar="SECONDS",
        help="give up on a collective after this long (default: $PARALLELX_TIMEOUT or 1800)" + NONE_IN_WORDS,
    )
    group.add_argument(
        "--dump-stacks",
        default=None,
        metavar="DIR",
        help="when the ranks part ways, each writes its Python stack to DIR/rank-<N>.txt, named in the verdict "
        "(default: $PARALLELX_DUMP_STACKS, else none)" + NONE_IN_WORDS,
    )
    loop = options.add_argument_group("training loop (the same update on every backend)")
    loop.add_argument(
        "--accumulate",
        type=positive_int,
        default=None,
        metavar="N",
        help="micro-batches per optimizer step: gradient accumulation (default: 1)" + NONE_IN_WORDS,
    )
    loop.add_argument(
        "--clip-grad-norm",
        type=positive_float,
        default=None,
        metavar="X",
        help="clip the averaged gradients to this global 2-norm (default: no clipping)" + NONE_IN_WORDS,
    )
    loop.add_argument(
        "--precision",
        choices=PRECISIONS,
        default=None,
        help="32, bf16-mixed (autocast; CPU and GPU), 16-mixed (autocast + loss scaling; GPUs) or "
        "bf16-compute (a bfloat16 copy of the weights gathered and computed on; float32 weights, "
        "gradients and update) (default: 32)" + NONE_IN_WORDS,
    )
    loop.add_argument(
        "--grad-compression",
        choices=COMPRESSIONS,
        default=None,
        help="gradient data type on the wire (default: none)" + NONE_IN_WORDS,
    )
    model = options.add_argument_group("model (applied by backend.wrap_model, as each backend needs)")
    model.add_argument(
        "--compile",
        action="store_true",
        type=compile_value,
        metavar="BOOL|MODE",
        help="torch.compile the model: ddp's wrapper (its buckets still overlap), fsdp's units before "
        "sharding, DeepSpeed's engine, the model elsewhere; --compile=MODE is --compile-mode MODE",
    )
    model.add_argument(
        "--compile-mode",
        choices=MODES,
        default=None,
        help="torch.compile's mode (implies --compile; default: default)" + NONE_IN_WORDS,
    )
    model.add_argument(
        "--compile-random",
        choices=("eager", "inductor"),
        default=None,
        help="under --compile, dropout and other random operators draw eager's numbers (the same as "
        "without --compile, on every backend; the default) or inductor's own (faster on GPUs, other "
        "masks; implies --compile)" + NONE_IN_WORDS,
    )
    model.add_argument(
        "--activation-checkpointing",
        nargs="?",
        const="auto",
        default=None,
        metavar="CLASSES",
        help="recompute these modules' activations in the backward: auto (the blocks fsdp shards) or class "
        "names, e.g. Block (default: off; the flag alone: auto)" + NONE_IN_WORDS,
    )
    model.add_argument(
        "--cpu-offload",
        action="store_true",
        help="keep sharded state in CPU memory between uses, on GPUs: fsdp's parameters and gradients "
        "(CPUOffloadPolicy), DeepSpeed ZeRO's optimizer state (offload_optimizer)",
    )
    model.add_argument(
        "--tensor-parallel",
        type=positive_int,
        default=None,
        metavar="N",
        help="split each transformer block's layers over N ranks (tensor parallelism; fsdp, ddp, deepspeed ZeRO 0-2): the "
        "world becomes world/N data-parallel x N tensor-parallel ranks, and the N ranks of a group read the "
        "same batch (default: 1)" + NONE_IN_WORDS,
    )
    model.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="under --tensor-parallel, keep each rank's chunk of the sequence between the split layers "
        "(norms, dropout, the residual stream): less activation memory",
    )
    model.add_argument(
        "--loss-parallel",
        action="store_true",
        help="under --tensor-parallel, a training forward's logits stay in vocabulary shards (a DTensor) and "
        "F.cross_entropy runs on them: the logits' memory divided by N (evaluation and generation get them "
        "whole; anything else done with a training forward's logits takes logits.full_tensor())",
    )
    _add_tracking(options)
    for name in names:
        if name == "auto":
            continue
        try:
            # Options stands in for the parser: the backend's options get the same prefix and conflict rule.
            backend_class(name).add_arguments(cast(argparse.ArgumentParser, options))
        except ImportError:  # a broken third-party backend must not break the CLI
            continue
    options.finish()
    return parser


def loggers_type(text: str) -> tuple[str, ...]:
    """argparse type: comma-separated tracker names."""
    try:
        return parse_loggers(text)
    except ParallelxError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_tracking_arguments(parser: argparse.ArgumentParser, *, prefix: str = "") -> None:
    """``--logger``, ``--logger-dir``, ``--logger-every``, ``--peak-tflops``,
    ``--tokens-per-sample``, ``--profile-steps``, ``--memory-snapshot`` (docs/trackers.md),
    under :func:`add_arguments`' rule: the script's own options win."""
    options = Options(parser, prefix)
    _add_tracking(options)
    options.finish()


def _add_tracking(options: Options) -> None:
    group = options.add_argument_group("trackers, throughput and profiles")
    group.add_argument(
        "--logger",
        dest="loggers",
        type=loggers_type,
        default=None,
        metavar="NAMES",
        help=f"comma-separated trackers: {', '.join(available_trackers())} (default: none)" + NONE_IN_WORDS,
    )
    group.add_argument(
        "--logger-dir",
        type=str,
        default=None,
        metavar="DIR",
        help="the run directory for the trackers' files and the profiles (default: runs/<date>-<time>)" + NONE_IN_WORDS,
    )
    group.add_argument(
        "--logger-every",
        type=positive_int,
        default=None,
        metavar="STEPS",
        help=f"optimizer steps per logging interval (default: {DEFAULT_LOG_EVERY})" + NONE_IN_WORDS,
    )
    group.add_argument(
        "--peak-tflops",
        type=positive_float,
        default=None,
        metavar="X",
        help="peak TFLOP/s of one device, for MFU (default: from the table of GPUs)" + NONE_IN_WORDS,
    )
    group.add_argument(
        "--tokens-per-sample",
        type=positive_int,
        default=None,
        metavar="N",
        help="tokens in one sample, for tokens/s (default: not reported)" + NONE_IN_WORDS,
    )
    group.add_argument(
        "--profile-steps",
        default=None,
        metavar="A:B",
        help="record torch.profiler for optimizer steps A to B (from 1), a trace per rank (default: none)"
        + NONE_IN_WORDS,
    )
    group.add_argument(
        "--memory-snapshot",
        action="store_true",
        help="with --profile-steps on GPUs: also record the CUDA memory history of those steps",
    )


def from_args(args: argparse.Namespace, *, prefix: str | None = None, **overrides: Any) -> Backend:
    """Create (not init) the backend that ``args.backend`` names (``auto``
    included), with the options the parsed arguments give it; the parsed
    arguments are the run's hyperparameters for its trackers.  ``overrides``
    are constructor options that win over the arguments' (a script's own
    choices); one that only another backend takes (a ZeRO stage from the
    script's own ``--stage``, on ddp) is ignored, as :func:`parallelx.get_backend`
    does; ``monitor={...}``
    changes only the fields it names, e.g.
    ``from_args(args, monitor={"throughput": True})`` for a progress bar's
    throughput without a ``--logger``.

    An option :func:`add_arguments` left to the script (the script's own
    ``--device``) takes parallelx's default, not the script's value.  The
    namespace says which prefix its options have; ``prefix`` is needed only
    for a namespace that ``add_arguments``' parser did not fill, and must
    match it otherwise."""
    ours = parallelx_args(args, prefix)
    name = getattr(ours, "backend", "auto") or "auto"
    if name == "auto":
        name = detect_backend()
    options = backend_class(name).options_from_args(ours)
    monitor = MonitorOptions.from_args(ours)
    if (changes := overrides.pop("monitor", None)) is not None:
        monitor = dataclasses.replace(monitor, **dict(changes)) if isinstance(changes, Mapping) else changes
    backend = get_backend(name, monitor=monitor, **{**options, **overrides})
    backend.monitor.log_hyperparams({k: v for k, v in vars(args).items() if k != LAYOUT})
    return backend


def parallelx_args(args: argparse.Namespace, prefix: str | None = None) -> argparse.Namespace:
    """``args`` as the backends read it: each of parallelx's options under its
    own dest (``device``, not ``px_device``), parallelx's default for each
    option left to the script, ``--compile=MODE`` as ``--compile-mode MODE``;
    the script's other values as they are (DeepSpeed reads ``batch_size``).
    Warns once, on rank 0, which options were left to the script."""
    values = {k: v for k, v in vars(args).items() if k != LAYOUT}
    layout = getattr(args, LAYOUT, None)
    if not isinstance(layout, Layout):
        # A namespace made by hand, or by a parser add_arguments did not fill: names as they are, less the prefix.
        if prefix:
            start = prefix.replace("-", "_")
            values.update({k[len(start) :]: v for k, v in list(values.items()) if k.startswith(start)})
        return _compile_mode(argparse.Namespace(**values))
    if prefix is not None and prefix != layout.prefix:
        raise ParallelxError(
            f"from_args(prefix={prefix!r}), but add_arguments added parallelx's options with prefix "
            f"{layout.prefix!r}: pass the same prefix, or none"
        )
    for dest, option in layout.options.items():
        values[dest] = option["default"] if option["as"] is None else getattr(args, option["as"], option["default"])
    if skipped := layout.skipped_unsaid():
        _warn_skipped(skipped)
    return _compile_mode(argparse.Namespace(**values))


def _compile_mode(args: argparse.Namespace) -> argparse.Namespace:
    """``--compile=MODE`` is ``--compile --compile-mode MODE``."""
    value = getattr(args, "compile", False)
    if isinstance(value, str):
        mode = getattr(args, "compile_mode", None)
        if mode is not None and mode != value:
            raise ParallelxError(
                f"--compile={value} and --compile-mode {mode} name two modes: give one (--compile-mode {mode})"
            )
        args.compile, args.compile_mode = True, value
    return args


def _warn_skipped(skipped: Mapping[str, Mapping[str, Any]]) -> None:
    try:
        rank = detect_environment().world().rank
    except Exception:  # a half-set launcher environment: init() says what is wrong, not this warning
        rank = 0
    if rank != 0:
        return
    flags = [o["flags"][0] for o in skipped.values()]
    defaults = ", ".join(f"{dest}={o['default']}" for dest, o in skipped.items())
    warn(
        f"the script's own {', '.join(flags)} {'is' if len(flags) == 1 else 'are'} the script's, not parallelx's: "
        f"the backend takes parallelx's defaults ({defaults}); to set them from the command line, "
        f'add parallelx\'s options with a prefix: parallelx.add_arguments(parser, prefix="px-") '
        f"offers {', '.join('--px-' + f.lstrip('-') for f in flags)}"
    )


# Aliases, documented as such.
add_backend_arguments = add_arguments
backend_from_args = from_args
