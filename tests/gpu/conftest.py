"""The GPU tier (`pytest -m gpu tests/gpu`; skipped without CUDA by tests/conftest.py): every test
here must carry the `gpu` marker, or a CPU run would execute it and `-m gpu` would miss it."""

import os

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config, items):
    unmarked = [item.nodeid for item in items
                if str(item.path).startswith(_HERE) and item.get_closest_marker("gpu") is None]
    if unmarked:
        raise pytest.UsageError(f"tests in tests/gpu without @pytest.mark.gpu: {unmarked}")
