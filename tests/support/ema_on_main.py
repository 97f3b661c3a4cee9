"""``examples/ema.py`` with a mistake ``python -m parallelx check`` must see: the
average is updated on rank 0 only, so the ranks' EMAs part after its first
update while their models stay equal (tests/launcher/test_model_examples.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import parallelx

spec = importlib.util.spec_from_file_location(
    "example_ema", Path(__file__).resolve().parents[2] / "examples" / "ema.py"
)
assert spec is not None and spec.loader is not None
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)


class OnMain(parallelx.EMA):
    def update(self) -> bool:
        return super().update() if self.backend.is_main() else False


example.parallelx.EMA = OnMain  # type: ignore[misc]
if __name__ == "__main__":
    example.main()
