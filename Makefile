# The two entry points of the README: both set everything up on a fresh clone.
PY := .venv/bin/python
# DeepSpeed's JIT-built ops are tied to the torch they were built with: keep
# them per environment, so two checkouts do not keep rebuilding each other's.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.venv/torch_extensions

.PHONY: setup train test test-fast bench clean

setup:
	bash scripts/setup.sh

## Train CIFAR-10 LeNet with 2 DDP processes on generated data (outputs in runs/).
train: setup
	bash scripts/train_demo.sh

## The whole test suite: unit, multirank, launcher (every backend under its real launcher),
## system (faults, restarts, the CLI, benchmarks), on two pytest-xdist workers (a third of a
## serial run is waiting; tests/conftest.py keeps files that share launches on one worker).
test: setup
	$(PY) -m pytest -n 2 tests/unit tests/multirank tests/launcher tests/system

## The in-process tiers (tests/unit, tests/multirank): no subprocess at all, about 10 s.
test-fast: setup
	$(PY) -m pytest tests/unit tests/multirank

## The benchmark table on this machine (quick mode, about 4 minutes on 2 cores).
bench: setup
	$(PY) -m benchmarks.run --mode quick

clean:
	rm -rf runs data .pytest_cache
