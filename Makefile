# Two commands for a newcomer: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_CPU_VERSION := 2.13.0

.PHONY: setup test demo clean

# The venv sees system site-packages so that an installed torch (NVIDIA containers) is reused;
# torch is installed (CPU build, pinned) only when none is importable.
$(VENV)/.installed: pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install --quiet torch==$(TORCH_CPU_VERSION)
	$(PIP) install --quiet -e ".[dev,hf]"
	touch $@

setup: $(VENV)/.installed

test: setup
	$(PY) -m pytest -q tests

demo: setup
	$(PY) -m megatron_mea.cli.demo

clean:
	rm -rf $(VENV) build *.egg-info
