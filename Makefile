# Two commands for a newcomer: `make demo` and `make test`. Both set up a venv first.
# The default leg is Python 3.11 + megatron-core 0.16.1 in .venv; another Megatron-Core gets a
# venv of its own, e.g. `make test PYTHON=python3.12 MCORE=0.19.2` (.venv-mcore0.19.2).
PYTHON ?= python3
MCORE ?= 0.16.1
VENV ?= $(if $(filter 0.16.1,$(MCORE)),.venv,.venv-mcore$(MCORE))
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION := 2.13.0

.PHONY: setup test demo clean

# The venv sees system site-packages so that an installed torch (NVIDIA containers) is reused;
# torch is installed (pinned; the CPU build where the index has one) only when none is importable.
# megatron-core is installed bare: its extras pull CUDA-only packages.
$(VENV)/.installed: pyproject.toml setup.py
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found (needed for MCORE=$(MCORE))" >&2; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install --quiet torch==$(TORCH_VERSION)
	$(PIP) install --quiet "megatron-core==$(MCORE)" -e ".[dev,hf]"
	touch $@

setup: $(VENV)/.installed

test: setup
	$(PY) -m pytest -q tests

demo: setup
	$(PY) -m megatron_mea.cli.demo

clean:
	rm -rf .venv .venv-mcore* build *.egg-info
