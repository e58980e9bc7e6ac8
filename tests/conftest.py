"""Shared fixtures: a one-rank gloo group with Megatron's parallel state for in-process tests."""

import logging
import os
import warnings

import pytest
import torch

from megatron_mea.cpu import megatron_on_cpu
from tests._dist import free_port

warnings.filterwarnings("ignore", message="Apex is not installed")


@pytest.fixture(scope="session", autouse=True)
def _megatron_on_cpu():
    """The in-process tests run as one entry point: Megatron-Core patched for CPU throughout
    (nothing is patched where CUDA exists). Spawned ranks enter it themselves (tests/_dist.py)."""
    with megatron_on_cpu():
        yield


@pytest.fixture(scope="session")
def single_rank():
    """Megatron parallel state at TP=1/EP=1 on a world of one process (gloo, CPU)."""
    import torch.distributed as dist

    from tests._models import init_parallel

    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    init_parallel(tp=1, ep=1)
    yield
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def tool_logging(monkeypatch):
    """For every test (a tool's `main()` run in-process among them): the root logger's handlers
    and level are put back after it. A tool installs its console handler on the `sys.stderr` of
    the moment, the test's captured stream, which is closed after the test: records of later
    tests would print `--- Logging error ---` into their own captured stderr."""
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", list(root.handlers))
    monkeypatch.setattr(root, "level", root.level)


def _release_series() -> str:
    from importlib.metadata import version

    return ".".join(version("megatron-core").split(".")[:2])


def pytest_collection_modifyitems(config, items):
    """Deselects the tests marked `one_release` with another release series than the installed
    Megatron-Core's: tests of the applications' own behaviour, which does not change with the
    release (the library calls beneath them are tested on both), so that the two CI legs do not
    both spend their minutes on them. Tests marked `gpu` (the tier in tests/gpu, `pytest -m gpu`)
    need a CUDA device: skipped without one. (`slow` needs nothing here: `-m` selects on it.)"""
    series = _release_series()
    other = [item for item in items if _release_of(item) not in (None, series)]
    if other:
        config.hook.pytest_deselected(items=other)
        items[:] = [item for item in items if item not in other]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (the GPU tier: pytest -m gpu)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def _release_of(item):
    """The release series of the item's `one_release` marker ("0.16"), or None without one."""
    marker = item.get_closest_marker("one_release")
    if marker is None:
        return None
    (series,) = marker.args
    return series
