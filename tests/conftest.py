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


# The slow tier: multi-process worlds, kill drills, console scripts in subprocesses, the
# acceptance smoke, the fuzzers. `make test-fast` (`pytest -m "not slow"`) leaves them out for
# quick development loops; `make test` and CI run everything. Paths relative to the repository,
# a file or a folder, or a node id prefix.
SLOW = (
    "tests/distributed/",
    "tests/training/test_multinode.py",
    "tests/training/test_pipeline.py",
    "tests/training/test_pretrain.py",
    "tests/training/test_reliability.py",
    "tests/training/test_resharding.py",
    "tests/training/test_lr_sweep.py",
    "tests/training/test_reproduce.py",
    "tests/training/test_gpu_configuration.py",
    "tests/inference/test_tensor_parallel.py",
    "tests/checkpoint/test_compress.py::test_norm_then_mix",
    "tests/inference/test_imported_checkpoint.py",
    "tests/inference/test_cli.py",
    "tests/checkpoint/test_cli.py",
    "tests/training/test_bad_inputs.py::test_the_dataset_index_cache_goes_into_the_run_directory",
    "tests/checkpoint/test_evaluation.py::test_cli_loads_an_older_checkpoint",
    "tests/test_gpu_acceptance.py::test_cpu_smoke_on_a_simulated",
    "tests/test_config_fuzz.py",
    "tests/test_bench_attention.py",
    "tests/test_console_scripts.py",
    "tests/test_docs.py",
    "tests/test_compat.py::test_batch_is_",
    "tests/test_cpu_support.py::test_nothing_is_patched_when_cuda_is_available",
    "tests/test_cpu_support.py::test_patches_are_undone_when_the_outermost_block_ends",
    "tests/layers/test_sdpa_attention.py::test_sdpa_equals_megatrons_core_attention_at_tp2",
    "tests/checkpoint/test_hf_roundtrip.py::test_logits_at_tp2",
    "tests/integrations/test_examples_dry_run.py",
    "tests/integrations/test_compress_example.py",
    "tests/integrations/test_megatron_lm_cpu.py",
    "tests/integrations/test_megatron_lm_export.py",
    "tests/test_demo.py",
    "tests/test_cli_quiet.py::test_mea_",
)
# Tests of the applications' own behaviour, which does not change with the Megatron-Core release
# (the library calls beneath them are tested on both): each runs with one release only, so
# the two CI legs do not both spend their minutes on it. Path prefix -> the release series it
# runs with (the other leg deselects it and says how many in its summary).
ONE_RELEASE = {
    # The LR-sweep driver (grid, resumption, verdicts, plots), the benchmark's byte accounting,
    # run-directory locks, console-script entry points, torchrun's multi-agent launch, the
    # lm-eval harness on an export, the demo: the application code around Megatron-Core.
    "tests/training/test_lr_sweep.py": "0.16",
    "tests/training/test_reproduce.py": "0.16",
    "tests/test_bench_attention.py": "0.16",
    "tests/training/test_run_directories.py": "0.16",
    "tests/test_console_scripts.py": "0.16",
    "tests/test_cli_refusals.py": "0.16",
    "tests/training/test_multinode.py": "0.16",
    "tests/checkpoint/test_evaluation.py": "0.16",
    # Regenerated data trains (the cache key itself is tested on both, in tests/data).
    "tests/training/test_reliability.py::test_data_regenerated": "0.16",
    # The signal handler's own rules (a duplicate held, a second Ctrl-C; a signal during
    # set-up); the signals as clusters deliver them during training run on both.
    "tests/training/test_reliability.py::test_a_duplicate_sigterm": "0.16",
    "tests/training/test_reliability.py::test_a_signal_during_set_up": "0.16",
    # A timeout during set-up (the dataset builder re-raises it) and a disk that fills inside
    # torch's writer: the other leg has the timeout in a step and the full disk at a save.
    "tests/training/test_reliability.py::test_a_rank_that_stops_during_set_up": "0.19",
    "tests/training/test_reliability.py::test_a_full_disk_at_save_time_ends_in_one_line_and_"
    "leaves_no_tmp[fills": "0.19",
    # `make demo`: its reruns, its console and its log files.
    "tests/test_demo.py": "0.16",
    # Command lines of mea-pretrain and mea-preprocess on damaged or foreign input, a full disk
    # (the checks themselves are tested on both, in tests/data).
    "tests/data/test_dataset_checks.py::test_mea_pretrain_refuses_a_damaged_index": "0.16",
    "tests/data/test_preprocess.py::test_a_megatron_lm_command_line_runs_unchanged": "0.16",
    "tests/data/test_preprocess.py::test_a_full_disk_is_one_line": "0.16",
    # The lent GPU machine runs Python 3.12 with megatron-core 0.19 (its wheels are built so).
    "tests/test_gpu_acceptance.py::test_cpu_smoke_on_a_simulated": "0.19",
}
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _release_series() -> str:
    from importlib.metadata import version

    return ".".join(version("megatron-core").split(".")[:2])


def pytest_collection_modifyitems(config, items):
    """Marks the `SLOW` tests `slow`; deselects the `ONE_RELEASE` tests of the other release.
    Tests marked `gpu` (the tier in tests/gpu, `pytest -m gpu`) need a CUDA device: skipped
    without one."""
    series = _release_series()
    other = [item for item in items if any(
        _node(item).startswith(prefix) and release != series
        for prefix, release in ONE_RELEASE.items())]
    if other:
        config.hook.pytest_deselected(items=other)
        items[:] = [item for item in items if item not in other]
    for item in items:
        if _node(item).startswith(SLOW):
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (the GPU tier: pytest -m gpu)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def _node(item) -> str:
    return os.path.relpath(str(item.path), _ROOT) + "::" + item.name
