"""The vLLM tests run in the vLLM venv only (`make test-vllm`): elsewhere they are not collected.

`make test-vllm` runs pytest with `--confcutdir=tests/vllm`, so the suite's top-level conftest
(which imports Megatron-Core, absent from the vLLM venv) is not loaded.
"""

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("vllm") else ["test_*.py"]
