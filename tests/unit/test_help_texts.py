"""Every option's help shows its default exactly once: never "(default: ...)"
twice, never "(default: None)" (an option whose default is None says in words
what that means, or nothing), and the value of every other default.  For the
recipes' parsers, for parallelx's own options under argparse's plain and
ArgumentDefaultsHelpFormatter formatters, and for recipes/example.py's --help;
all in this process, from ``format_help()``."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable

import pytest

import parallelx


def _cifar10() -> tuple[argparse.ArgumentParser, str]:
    from recipes.cifar10 import build_parser

    parser = build_parser()
    return parser, parser.format_help()


def _dogcat() -> tuple[argparse.ArgumentParser, str]:
    from recipes.dogcat import build_parser

    parser = build_parser()
    return parser, parser.format_help()


def _gpt() -> tuple[argparse.ArgumentParser, str]:
    from recipes.gpt import build_parser

    parser = build_parser()
    return parser, parser.format_help()


def _plain(formatter: type[argparse.HelpFormatter]) -> Callable[[], tuple[argparse.ArgumentParser, str]]:
    def build() -> tuple[argparse.ArgumentParser, str]:
        parser = parallelx.add_arguments(argparse.ArgumentParser(formatter_class=formatter))
        return parser, parser.format_help()

    return build


PARSERS: dict[str, Callable[[], tuple[argparse.ArgumentParser, str]]] = {
    "cifar10": _cifar10,
    "dogcat": _dogcat,
    "gpt": _gpt,
    "parallelx-plain": _plain(argparse.HelpFormatter),
    "parallelx-defaults-formatter": _plain(argparse.ArgumentDefaultsHelpFormatter),
}


def option_entries(text: str) -> dict[str, str]:
    """Each option's entry in a --help text (its flags and help, on one line), by its first flag."""
    entries: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if re.match(r"  -", line):  # an entry starts two spaces in; its help continues further in
            current = entries.setdefault(line.split()[0].rstrip(","), [])
            current.append(line)
        elif current is not None and line.startswith("   "):
            current.append(line)
        else:
            current = None
    return {flag: " ".join(" ".join(lines).split()) for flag, lines in entries.items()}


def check_defaults_once(parser: argparse.ArgumentParser, text: str) -> None:
    entries = option_entries(text)
    assert "--backend" in entries and "--zero-stage" in entries, text  # parallelx's options and a backend's are there
    for flag, entry in entries.items():
        assert "(default: None)" not in entry, f"{flag} says '(default: None)': {entry}"
        assert entry.count("(default:") <= 1, f"{flag} states its default more than once: {entry}"
        if flag in ("-h", "--help"):
            continue
        default = parser.get_default(flag.lstrip("-").replace("-", "_"))
        if default is not None and default is not False:
            assert f"(default: {default})" in entry, f"{flag} does not show its default {default!r}: {entry}"


@pytest.mark.parametrize("name", list(PARSERS))
def test_each_option_shows_its_default_once(name):
    check_defaults_once(*PARSERS[name]())


def test_the_example_shows_each_default_once(capsys):
    from recipes import example

    with pytest.raises(SystemExit) as exit_:
        example.main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    # The defaults it should show: parallelx's own, and the five the example sets.
    parser = parallelx.add_arguments(argparse.ArgumentParser())
    parser.set_defaults(epochs=2, batch_size=32, lr=0.1, out="example.pth", seed=0)
    for flag in ("--epochs", "--batch-size", "--lr", "--out", "--seed"):
        assert flag in option_entries(text), text
    check_defaults_once(parser, text)
