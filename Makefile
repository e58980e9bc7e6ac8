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
	$(PIP) install --quiet "megatron-core==$(MCORE)" -e ".[dev,hf,megatron-lm]"
	touch $@

setup: $(VENV)/.installed

test: setup
	$(PY) -m pytest -q tests

demo: setup
	$(PY) -m megatron_mea.cli.demo

clean:
	rm -rf .venv .venv-mcore* build *.egg-info

# ---- GPU acceptance (docs/gpu.md) -----------------------------------------------------------
# `make gpu-wheels` (a machine with network) fills wheels/ with what a bare GPU machine (torch and
# CUDA, nothing else, no network) lacks: megatron-core, numpy, pyyaml and psutil for each Python
# in GPU_PYTHONS, pure-Python pytest (and its dependencies), tqdm and nvidia-ml-py, and this
# package's wheel (about 41 MiB for two Pythons). Carry wheels/ to the GPU machine.
GPU_PYTHONS ?= 3.11 3.12
GPU_PLATFORMS := --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	--platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64
.PHONY: gpu-wheels
gpu-wheels:
	rm -rf wheels && mkdir -p wheels
	for version in $(GPU_PYTHONS); do \
		$(PIP) download --quiet --no-deps --only-binary=:all: --implementation cp \
			--python-version $$version $(GPU_PLATFORMS) -d wheels \
			"megatron-core==$(MCORE)" numpy pyyaml psutil || exit 1; \
	done
	$(PIP) download --quiet --no-deps --only-binary=:all: -d wheels pytest pluggy iniconfig \
		pygments packaging pytest-timeout tqdm nvidia-ml-py
	rm -rf build  # setuptools' staging folder: stale modules there would land in the wheel
	$(PIP) wheel --quiet --no-deps --no-build-isolation -w wheels . && rm -rf build
	@du -sh wheels && ls wheels

# On the GPU machine (PY=python3 there: no venv): install what it lacks from wheels/ and run every
# GPU check (under 8 min); the report lands in $(GPU_OUT), by default $OUT if set.
# Without a GPU: make gpu-check GPU_CHECK_ARGS=--cpu-smoke
GPU_OUT ?= $(or $(OUT),runs/gpu_acceptance)
GPU_CHECK_ARGS ?=
.PHONY: gpu-check
gpu-check:
	PYTHON=$(PY) bash scripts/gpu_acceptance.sh --out $(GPU_OUT) $(GPU_CHECK_ARGS)
