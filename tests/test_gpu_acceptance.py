"""`mea-gpu-acceptance` kept working without a GPU: its `--cpu-smoke` run end to end (every step
but the CUDA-only ones), and its pieces (wheel selection, FLOP counts, peaks, checks, reports)."""

import json
import os
import socket
import subprocess
import sys

import pytest

from megatron_mea.acceptance import environment, report
from megatron_mea.cli import gpu_acceptance as acceptance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_cpu_smoke_runs_every_step_and_writes_the_report(tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, "-m", "megatron_mea.cli.gpu_acceptance", "--cpu-smoke",
               "--out", str(out)]
    # Called from a distributed process (as from this test session's gloo group), the run must
    # not reuse the caller's rendezvous: advertise a port that is taken.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(taken.getsockname()[1]),
                   RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900,
                             env=env)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-3000:]
    result = json.loads((out / "acceptance.json").read_text())
    assert result["mode"] == "cpu-smoke" and result["ok"]
    steps = result["steps"]
    assert list(steps) == ["environment", "gpu_tests", "training", "layer_bench"]
    assert all(step["ok"] for step in steps.values())
    assert result["environment"]["megatron_core"].split()[0][0].isdigit()
    # The GPU tier is collected, and every test in it is skipped without CUDA.
    tests = steps["gpu_tests"]
    assert tests["tests"] >= 20 and tests["skipped"] == tests["tests"]
    # Three runs through mea-pretrain's Trainer: finite, falling losses and rates.
    runs = steps["training"]["runs"]
    assert list(runs) == ["baseline", "mea-virtual", "kha"]
    for row in runs.values():
        assert row["ok"] and row["all_finite"] and row["falling"], row
        assert row["tokens_per_s"] > 0 and row["model_tflops_per_s"] > 0
        assert row["mfu"] is None  # no peak for a CPU
    assert runs["baseline"]["step_time_ratio"] == 1.0
    # The layer benchmark at both shapes, with both core attentions of the local spec.
    shapes = steps["layer_bench"]["shapes"]
    assert list(shapes) == ["h64-local", "h128-local"]
    for shape in shapes.values():
        assert list(shape["core_attention"]) == ["megatron", "sdpa"]
        for rows in shape["core_attention"].values():
            assert len(rows) == 6 and rows["baseline"]["layer_ratio"] == 1.0
            assert all(r["layer_ms"] > 0 and r["layer_tflops"] > 0 for r in rows.values())
    summary = (out / "summary.txt").read_text()
    assert "PASSED" in summary and "mea-virtual" in summary and "core attention sdpa" in summary
    for log in ("gpu_tests.log", "training.log", "bench_h64-local.log"):
        assert (out / log).exists()


def test_without_cuda_and_without_smoke_it_refuses(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert acceptance.main(["--out", str(tmp_path)]) == 2


def test_missing_wheels_installs_pinned_packages_and_only_absent_others(tmp_path):
    for name in [
        "megatron_core-0.16.1-cp311-cp311-manylinux_2_28_x86_64.whl",
        "megatron_core-0.16.1-cp312-cp312-manylinux_2_28_x86_64.whl",
        "megatron_mea-0.1.0-py3-none-any.whl",
        "pytest-9.0.0-py3-none-any.whl",  # installed here: kept
        "numpy-2.4.6-cp311-cp311-manylinux_2_28_x86_64.whl",  # installed here: kept
        "Surely_Absent.Pkg-1.0-py3-none-any.whl",
        "notes.txt",
    ]:
        (tmp_path / name).write_text("")
    assert sorted(environment.missing_wheels(str(tmp_path))) == [
        "megatron-core", "megatron-mea", "surely-absent-pkg"]


def test_bootstrap_script_without_wheels_runs_the_module(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, MEA_WHEELS=str(tmp_path / "none"))
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "surely_absent_pkg-1.0-py3-none-any.whl").write_text("")
    run = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_acceptance.sh"),
                          "--missing-wheels", str(tmp_path / "w")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "no wheels" in run.stdout and "surely-absent-pkg" in run.stdout


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H200", 989.4),
    ("NVIDIA GH200 480GB", 989.4), ("NVIDIA A100-SXM4-80GB", 312.0), ("Tesla T4", None),
    (None, None),
])
def test_peak_from_the_device_name(name, peak):
    assert environment.peak_bf16_tflops(name) == peak


def test_training_flops_agree_with_the_layer_benchmark():
    from argparse import Namespace

    from megatron_mea.bench.steps import layer_flops

    bench = Namespace(hidden_size=2048, num_attention_heads=16, num_query_groups=4,
                      seq_length=4096, micro_batch_size=1, ffn_hidden_size=None)
    shape = dict(num_layers=1, hidden_size=2048, num_attention_heads=16, num_query_groups=4,
                 seq_length=4096, swiglu=False, vocab_size=0)
    per_token = report.train_flops_per_token(shape)
    assert per_token * 4096 == pytest.approx(layer_flops(bench))
    # SwiGLU: three h x ffn matrices instead of two; the output layer counts once.
    swiglu = report.train_flops_per_token(dict(shape, swiglu=True, vocab_size=1000))
    assert swiglu - per_token == pytest.approx(3 * (2 * 2048 * 8192 + 2 * 2048 * 1000))


def test_loss_falls_and_summaries():
    assert report.loss_falls([5.0, 4.8, 4.0, 3.0, 2.0, 1.9])["falling"]
    assert not report.loss_falls([5.0, 5.1, 5.0, 4.9, 5.0, 5.0])["falling"]
    raw = {"losses": [5.0] * 6 + [float("nan")] + [1.0] * 6, "step_seconds": [0.5] * 13,
           "iters_planned": 13, "build_s": 1.0, "skipped_steps": 0, "tokens_per_step": 1000,
           "shape": dict(num_layers=2, hidden_size=64, num_attention_heads=4,
                         num_query_groups=2, seq_length=64, vocab_size=384)}
    row = report.summarize_run(raw, peak_tflops=100.0)
    assert not row["ok"] and not row["all_finite"] and row["falling"]
    assert row["tokens_per_s"] == 2000 and row["mfu"] == pytest.approx(
        row["model_tflops_per_s"] / 100.0)
    assert report.summarize_run({"error": "boom"}, None) == {"ok": False, "error": "boom"}


def test_junit_counts(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
        '<testcase classname="a" name="t1"/>'
        '<testcase classname="a" name="t2"><failure message="bad&#10;more"/></testcase>'
        '<testcase classname="a" name="t3"><skipped message="no CUDA"/></testcase>'
        "</testsuite></testsuites>")
    counts = report.junit_counts(str(xml))
    assert (counts["tests"], counts["passed"], counts["failed"], counts["skipped"]) == (3, 1, 1, 1)
    assert counts["not_passed"] == ["failure: a::t2 -- bad", "skipped: a::t3 -- no CUDA"]
