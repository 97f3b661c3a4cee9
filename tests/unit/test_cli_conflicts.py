"""A script's own options and parallelx's on one parser (parallelx.cli): the
script's own option wins, parallelx says which of its options it left and how
to reach them (a prefix), every on/off flag takes an explicit value
(nanoGPT's ``--compile=True``), and what the backend's constructor receives."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest

import parallelx
from parallelx import cli
from parallelx.errors import ParallelxError

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    """What from_args hands get_backend: (name, keyword options) per call; the backend is still built."""
    calls: list[tuple[str, dict[str, Any]]] = []
    real = cli.get_backend

    def spy(name: str, **options: Any) -> parallelx.Backend:
        calls.append((name, options))
        return real(name, **options)

    monkeypatch.setattr(cli, "get_backend", spy)
    return calls


def script_parser() -> argparse.ArgumentParser:
    """A torchvision/nanoGPT-style script: its own --backend (meaning something else), --device and --compile."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="inductor", help="the script's torch.compile backend")
    parser.add_argument("--device", default="cuda", help="the script's device string")
    parser.add_argument("--compile", type=lambda s: s == "True", default=False, help="nanoGPT's style")
    parser.add_argument("--clip-grad-norm", type=float, default=None)
    parser.add_argument("--batch-size", type=int, default=8)
    return parser


def test_the_scripts_own_options_win_and_the_backend_gets_parallelx_defaults(built, capsys):
    parser = script_parser()
    assert parallelx.add_arguments(parser) is parser  # no "conflicting option string"
    args = parser.parse_args(
        [
            "--backend",
            "aot_eager",
            "--device",
            "cuda:1",
            "--compile=True",
            "--clip-grad-norm",
            "5",
            "--precision",
            "bf16-mixed",
        ]
    )
    # The script's values land in the script's dests.
    assert (args.backend, args.device, args.compile, args.clip_grad_norm) == ("aot_eager", "cuda:1", True, 5.0)
    assert args.precision == "bf16-mixed" and args.batch_size == 8  # parallelx's option that did not clash
    # Single (the script's --backend is not read): auto would follow the launcher, so build "single" by default.
    parser2 = script_parser()
    parallelx.add_arguments(parser2, "single")
    backend = parallelx.from_args(parser2.parse_args(["--device", "cuda:1", "--compile=True", "--clip-grad-norm", "5"]))
    name, options = built[-1]
    assert name == "single" and backend.name == "single"
    # None of the script's --device, --compile, --clip-grad-norm configured the backend.
    assert "device" not in options and "compile" not in options and "clip_grad_norm" not in options
    assert backend.options.clip_grad_norm is None
    err = capsys.readouterr().err
    assert (
        "parallelx: warning: the script's own --backend, --device, --clip-grad-norm, --compile are the script's" in err
    )
    assert 'prefix="px-"' in err and "--px-device" in err and "--px-compile" in err
    # Said once.
    parallelx.from_args(parser2.parse_args([]))
    assert "warning" not in capsys.readouterr().err


def test_the_default_backend_argument_is_the_skipped_backends_value(built):
    parser = script_parser()
    parallelx.add_arguments(parser, "single")
    args = parser.parse_args(["--backend", "ddp"])  # the script's: not parallelx's ddp
    parallelx.from_args(args)
    assert built[-1][0] == "single"


def test_a_prefix_lets_both_coexist(built):
    parser = script_parser()
    parallelx.add_arguments(parser, prefix="px-")
    help_text = parser.format_help()
    assert "--px-backend" in help_text and "--px-zero-stage" in help_text and "--px-fsdp-shard" in help_text
    assert "\nparallelx:\n" in help_text  # the group's title
    args = parser.parse_args(
        ["--backend", "aot_eager", "--device", "cuda:1", "--compile=True", "--px-backend", "single", "--px-compile"]
        + ["--px-clip-grad-norm", "2", "--clip-grad-norm", "7", "--px-fsdp-sharded-checkpoints=yes", "--local_rank=0"]
    )
    assert (args.backend, args.device, args.compile, args.clip_grad_norm) == ("aot_eager", "cuda:1", True, 7.0)
    assert (args.px_backend, args.px_device, args.px_compile, args.px_clip_grad_norm) == ("single", "auto", True, 2.0)
    assert args.px_fsdp_sharded_checkpoints is True and args.local_rank == 0  # a launcher's flag keeps its name
    backend = parallelx.from_args(args, prefix="px-")
    name, options = built[-1]
    assert name == "single" and options["compile"] is True and options["clip_grad_norm"] == 2.0
    assert "device" not in options and backend.options.clip_grad_norm == 2.0
    assert parallelx.from_args(args).name == "single"  # the namespace knows its prefix
    with pytest.raises(ParallelxError, match="prefix 'px-'"):
        parallelx.from_args(args, prefix="pl-")


def test_backends_own_options_follow_the_same_rule(built):
    parser = argparse.ArgumentParser()
    parser.add_argument("--zero-stage", default="three")  # the script's own
    parallelx.add_arguments(parser)
    args = parser.parse_args(["--backend", "single", "--zero-stage", "x", "--fsdp-no-reshard-after-forward=true"])
    assert args.zero_stage == "x" and args.fsdp_no_reshard_after_forward is True
    ours = cli.parallelx_args(args)
    assert ours.zero_stage is None and ours.fsdp_no_reshard_after_forward is True
    assert args._parallelx.skipped().keys() == {"zero_stage"}


def test_a_dest_the_script_uses_is_also_left_to_it():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dev", dest="device", default="cuda:0")
    parallelx.add_arguments(parser)
    assert "--device" not in parser.format_help()
    args = parser.parse_args(["--dev", "cuda:3"])
    assert args.device == "cuda:3" and cli.parallelx_args(args).device == "auto"


@pytest.mark.parametrize(
    ("argv", "value"),
    [
        ([], False),
        (["--compile"], True),
        (["--compile=True"], True),
        (["--compile=true"], True),
        (["--compile=1"], True),
        (["--compile=yes"], True),
        (["--compile=False"], False),
        (["--compile=false"], False),
        (["--compile=0"], False),
        (["--compile", "no"], False),
        (["--compile=max-autotune"], "max-autotune"),
    ],
)
def test_compile_is_a_flag_that_takes_a_value(built, argv, value):
    parser = parallelx.add_arguments(argparse.ArgumentParser(), "single")
    args = parser.parse_args(argv)
    assert args.compile == value
    parallelx.from_args(args)
    assert built[-1][1].get("compile", False) == value  # --compile=MODE is --compile-mode MODE


def test_every_on_off_flag_takes_a_value_and_a_bad_one_fails(capsys):
    parser = parallelx.add_arguments(argparse.ArgumentParser())
    args = parser.parse_args(
        ["--cpu-offload=no", "--memory-snapshot=on", "--fsdp-sharded-checkpoints", "--compile=off"]
    )
    assert (args.cpu_offload, args.memory_snapshot, args.fsdp_sharded_checkpoints, args.compile) == (
        False,
        True,
        True,
        False,
    )
    for bad in ("--compile=maybe", "--cpu-offload=2"):
        with pytest.raises(SystemExit):
            parser.parse_args([bad])
    assert "expected" in capsys.readouterr().err
    with pytest.raises(ParallelxError, match="two modes"):
        cli.parallelx_args(parser.parse_args(["--compile=max-autotune", "--compile-mode", "default"]))


def test_the_record_is_plain_data_and_a_second_call_adds_nothing():
    parser = parallelx.add_arguments(argparse.ArgumentParser(), title="distributed")
    assert "\ndistributed:\n" in parser.format_help()
    parallelx.add_arguments(parser)  # no conflicts with its own options, nothing skipped
    args = parser.parse_args([])
    assert not args._parallelx.skipped()
    json.dumps(vars(args))  # a script that saves its arguments still can
    assert "_parallelx=<parallelx options" in repr(args)
    with pytest.raises(ParallelxError, match="one prefix"):
        parallelx.add_arguments(parser, prefix="px-")


def test_a_namespace_made_by_hand_still_works(built):
    parallelx.from_args(argparse.Namespace(backend="single", device="cpu"))
    assert built[-1] == ("single", {"device": "cpu", "monitor": built[-1][1]["monitor"]})
    parallelx.from_args(argparse.Namespace(px_backend="single", px_accumulate=2, backend="x"), prefix="px-")
    assert built[-1][0] == "single" and built[-1][1]["accumulate"] == 2


@pytest.mark.parametrize(
    ("argv", "eager_random", "mode"),
    [
        (["--compile"], True, "default"),
        (["--compile-random", "inductor"], False, "default"),
        (["--compile-mode", "max-autotune", "--compile-random", "eager"], True, "max-autotune"),
    ],
)
def test_compiled_random_operators_draw_eagers_numbers_unless_told(built, argv, eager_random, mode):
    from parallelx.transforms.compiling import CompileOptions

    parallelx.from_args(parallelx.add_arguments(argparse.ArgumentParser(), "single").parse_args(argv))
    options = CompileOptions.of(built[-1][1]["compile"])
    assert (options.enabled, options.eager_random, options.mode) == (True, eager_random, mode)
    inductor = options.kwargs["options"]
    assert inductor["fallback_random"] is eager_random
    if mode == "max-autotune":  # the mode travels as the options it stands for
        assert inductor["max_autotune"] is True


# ------------------------------------------------------------- DeepSpeed's spellings
def deepspeed_parser(*, own_config_arguments: bool) -> argparse.ArgumentParser:
    """A script in DeepSpeed's tutorial style: its own --local_rank and --stage, and (as every DeepSpeed
    example) DeepSpeed's own add_config_arguments before parallelx's options."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--stage", type=int, default=0, choices=(0, 1, 2, 3))
    if own_config_arguments:
        deepspeed = pytest.importorskip("deepspeed")
        deepspeed.add_config_arguments(parser)
    return parallelx.add_arguments(parser, "single")


@pytest.mark.parametrize(
    ("own", "flag"),
    [(False, "--deepspeed_config"), (False, "--deepspeed-config"), (True, "--deepspeed_config")],
    ids=["underscore", "dash", "add_config_arguments"],
)
def test_deepspeeds_launch_line_parses_and_names_the_config(built, capsys, tmp_path, own, flag):
    config = tmp_path / "ds.json"
    config.write_text('{"zero_optimization": {"stage": 1}}')
    parser = deepspeed_parser(own_config_arguments=own)
    # The tutorial's launch line: `deepspeed train.py --deepspeed --deepspeed_config ds.json`, and the launcher's
    # --local_rank=N appended.  --deepspeed is not read as an abbreviation of --deepspeed-config.
    args = parser.parse_args(["--deepspeed", flag, str(config), "--local_rank=1", "--stage", "2"])
    assert args.deepspeed is True and args.local_rank == 1 and args.stage == 2
    assert cli.parallelx_args(args).deepspeed_config == str(config)  # the script's args.deepspeed_config
    capsys.readouterr()
    options = parallelx.backend_class("deepspeed").options_from_args(cli.parallelx_args(args))
    assert options["config"] == str(config)
    backend = parallelx.get_backend("deepspeed", config=options["config"])
    assert backend.strategy.config["zero_optimization"]["stage"] == 1
    # The script's own --local_rank (a launcher's value; parallelx reads the rank from the environment) and
    # DeepSpeed's own options are fine: no advice about defaults or --px- options.
    parallelx.from_args(args)
    err = capsys.readouterr().err
    assert "warning" not in err and "--px-local_rank" not in err


def test_deepspeed_alone_is_a_flag_not_an_abbreviation():
    parser = parallelx.add_arguments(argparse.ArgumentParser(), "single")
    args = parser.parse_args(["--deepspeed"])
    assert args.deepspeed is True and args.deepspeed_config is None
    # Under a prefix DeepSpeed's spellings keep their names (a launch line passes them as they are).
    prefixed = parallelx.add_arguments(argparse.ArgumentParser(), "single", prefix="px-")
    args = prefixed.parse_args(["--deepspeed", "--px-deepspeed_config", "a.json", "--local_rank=0"])
    assert args.deepspeed is True and args.px_deepspeed_config == "a.json" and args.local_rank == 0


def test_a_scripts_own_local_rank_gets_no_false_advice(built, capsys):
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--timeout", default="1h")  # still said: parallelx's --timeout is left to the script
    parallelx.add_arguments(parser, "single")
    parallelx.from_args(parser.parse_args(["--local_rank", "0"]))
    err = capsys.readouterr().err
    assert "the script's own --timeout is the script's" in err
    assert "local_rank" not in err


# ------------------------------------------------------- a script's own options, portably
@pytest.mark.parametrize("name", ["single", "ddp", "fsdp"])
def test_another_backends_option_is_ignored_and_said_once(capsys, name):
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, default=2)
    parallelx.add_arguments(parser, name)
    args = parser.parse_args([])
    backend = parallelx.from_args(args, zero_stage=args.stage)  # the tutorial's own --stage, on every backend
    assert backend.name == name
    out = capsys.readouterr().out
    assert f"parallelx: {name} ignores options of other backends (zero_stage is deepspeed's)" in out
    parallelx.get_backend(name, zero_stage=args.stage)
    assert "ignores" not in capsys.readouterr().out  # once per process
    # On the backend it concerns it is that backend's option.
    assert parallelx.get_backend("deepspeed", zero_stage=2).strategy.zero_stage == 2


def test_an_option_no_backend_takes_is_still_refused():
    with pytest.raises(parallelx.UnknownBackendError, match=r"does not accept 'zero_stag', and no registered backend"):
        parallelx.get_backend("ddp", zero_stag=2)
    with pytest.raises(parallelx.UnknownBackendError, match="zero_stage") as err:
        parallelx.from_args(argparse.Namespace(backend="single"), stage=2)
    assert "its options are: accumulate" in str(err.value)


@pytest.mark.parametrize("name", ["single", "ddp"])
def test_a_deepspeed_config_ignored_elsewhere_names_what_it_would_have_changed(capsys, name):
    """deepspeed adopts a config's gradient_clipping as --clip-grad-norm: the same script on another
    backend, which ignores the config, must not stop clipping without a word."""
    config = {"gradient_clipping": 1.0, "gradient_accumulation_steps": 2, "bf16": {"enabled": True}}
    parallelx.get_backend(name, config=config)
    err = capsys.readouterr().err
    assert f"parallelx: warning: {name} ignores the DeepSpeed config's gradient_clipping=1.0" in err
    assert "clip_grad_norm=1.0 (--clip-grad-norm 1.0)" in err
    assert "accumulate=2 (--accumulate 2)" in err and "precision='bf16-mixed'" in err
    # A config that changes nothing of the loop is ignored as any other backend's option is.
    parallelx.get_backend(name, config={"zero_optimization": {"stage": 2}, "gradient_clipping": 0.0})
    assert "warning" not in capsys.readouterr().err
