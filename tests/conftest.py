"""Shared fixtures: a one-rank gloo group with Megatron's parallel state for in-process tests."""

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


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` (the tier in tests/gpu, `pytest -m gpu`) need a CUDA device: skipped
    without one."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (the GPU tier: pytest -m gpu)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
