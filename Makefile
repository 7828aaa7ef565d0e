# The two commands: `make demo` (the main job) and `make test` (the test suite). Each installs
# what it needs first, so both work on a fresh machine.
PY ?= python3
NPROC ?= 4

.PHONY: install demo test cuda-check

install:
	PY=$(PY) bash scripts/install.sh

demo: install
	$(PY) -m torch.distributed.run --standalone --nproc-per-node $(NPROC) -m tp_ext demo

test: install
	PY=$(PY) bash scripts/check_cuda_compile.sh
	$(PY) -m pytest -q tests
