# The two commands: `make run` (the main job) and `make test` (the test suite). Each installs
# what it needs first, so both work on a fresh machine. `make test` runs the linters first
# (`make lint` alone: ruff, clang-format, import layers) and checks that the CUDA sources
# compile (nvcc, beside the tests). `make demo` runs the collectives demo.
# `make test-all` also runs the whole dims x schedule matrix of the pipeline tests.
PY ?= python3
NPROC ?= 8
# extra pytest arguments, e.g. `make test PYTEST_ARGS=--durations=30`
PYTEST_ARGS ?=
CONFIG ?= configs/qwen2-72b.yaml

.PHONY: install run demo test test-all lint

install:
	PY=$(PY) bash scripts/install.sh

run: install
	$(PY) -m torch.distributed.run --standalone --nproc-per-node $(NPROC) -m tp_ext run $(CONFIG)

demo: install
	$(PY) -m torch.distributed.run --standalone --nproc-per-node 4 -m tp_ext demo

lint: install
	PY=$(PY) bash scripts/lint.sh

# the linters, then the tests with the CUDA compile check beside them (scripts/test.sh says why)
test: install
	PY=$(PY) bash scripts/test.sh $(PYTEST_ARGS)

# every combination of the dims x schedule matrices (`make test` runs a subset covering every path)
test-all: install
	PY=$(PY) bash scripts/test.sh --full-matrix $(PYTEST_ARGS)
