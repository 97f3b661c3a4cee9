# The two entry points of the README: both set everything up on a fresh clone.
PY := .venv/bin/python
# DeepSpeed's JIT-built ops are tied to the torch they were built with: keep
# them per environment, so two checkouts do not keep rebuilding each other's.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.venv/torch_extensions

.PHONY: setup setup-core setup-test train test test-scenarios test-matrix test-all test-fast lint bench docs docs-serve clean

## Everything: DeepSpeed, Ray, the trackers, the dev and docs tools, Horovod's build (2.5 minutes the
## first time, then cached).  What the tests, lint, docs and benchmarks need.
setup:
	bash scripts/setup.sh all

## As setup, but Horovod's build (minutes on a new machine) runs in the background while the tests
## that do not need it run; those that do wait for it.
setup-test:
	bash scripts/setup.sh test

## The minimum the DDP demo needs: torch, torchvision and parallelx (no Horovod build).
setup-core:
	bash scripts/setup.sh core

## Train CIFAR-10 LeNet with 2 DDP processes on generated data (outputs in runs/).  Core set-up only.
train: setup-core
	bash scripts/train_demo.sh

## A launch that failed on one of two faults of the machine rather than of the code runs once more, and
## the rerun is reported (an R in the progress line, "rerun" in the summary): a C++ thread torn down at
## the interpreter's exit after the work was done ("terminate called without an active exception"), and
## a rendezvous that timed out while another rank was still starting on a loaded machine.  Any other
## failure, and the same fault twice, fails the run (docs/testing.md).  make test and the scenarios alike.
RERUN_FAULTS := terminate called without an active exception|DistStoreError: wait timeout

## The quick tier: unit, multirank, the core launch of every backend under its real launcher and one
## launch of each other grid (docs/testing.md), system (failures, bad inputs, the CLI, the wheel), on
## two pytest-xdist workers (tests/conftest.py keeps files that share launches on one worker).
## 4 to 13 minutes from a fresh clone on 2 cores, set-up included (242 s idle at 0aef424; 383 s and 765 s measured before): no
## Horovod, whose launches are scenarios.
test: setup-test
	$(PY) -m pytest -n 2 --durations=30 --reruns 1 --only-rerun "$(RERUN_FAULTS)" -m "not scenario and not matrix" tests/unit tests/multirank tests/launcher tests/system

## The rest of make test's grids (every backend and launcher for each), and the whole scenarios,
## minutes each: kills, restarts and preemption, stalls, Horovod elastic, Slurm, Ray, two nodes in
## network namespaces, the check on client scripts, the benchmarks and the GPU check rehearsed.  The
## longest tier; CI runs it after make test.
test-scenarios: setup
	$(PY) -m pytest -n 2 --durations=20 --reruns 1 --only-rerun "$(RERUN_FAULTS)" -m scenario tests/launcher tests/system

## The rest of the grids whose representatives make test runs (every way ranks part, under every
## backend): one launch each, 7 minutes on 2 cores (413 s measured); and the GPU check's CPU dry run, the
## peers' benchmark and the benchmark suite's rehearsals, 11 minutes more, kept out of CI's scenarios for
## CI's time (docs/testing.md).
test-matrix: setup
	$(PY) -m pytest -n 2 --durations=20 -m matrix tests/launcher tests/system

## Both, one after the other, as CI runs them.
test-all: test test-scenarios

## The in-process tiers (tests/unit, tests/multirank): no subprocess at all, about 40 s.
test-fast: setup
	$(PY) -m pytest tests/unit tests/multirank

## The benchmark table on this machine (quick mode, about 4 minutes on 2 cores).
bench: setup
	$(PY) -m benchmarks.run --mode quick

## Lint, formatting and types (ruff; mypy over parallelx/ and backends/), as CI runs them.
lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy

## The documentation site (docs/ and the API reference from the docstrings) into site/.
## Strict: a link to a missing page or anchor fails the build.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict
	@echo "docs: the site is in $(CURDIR)/site/ (open $(CURDIR)/site/index.html, or run make docs-serve)"

## The same site served at http://127.0.0.1:8000, rebuilt on every change.
docs-serve: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve

clean:
	rm -rf runs data site .pytest_cache
