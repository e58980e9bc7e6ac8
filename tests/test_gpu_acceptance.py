"""`mea-gpu-acceptance` kept working without a GPU: its `--cpu-smoke` run end to end on a
simulated GPU machine (offline install without pip, every step but the CUDA-only ones, the
packed report), and its pieces (wheel choice and unpacking, FLOP counts, peaks, checks, reports)."""

import importlib.util
import json
import os
import socket
import subprocess
import sys
import tarfile

import pytest

from megatron_mea.apps.acceptance import environment, install, report
from megatron_mea.cli import gpu_acceptance as acceptance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bare_python(sim):
    """A venv of this interpreter's Python without pip and without this venv's packages, where
    only torch and the distributions it requires are installed (links to this venv's): the
    GPU machine, which has torch and no megatron-core, no package index and perhaps no pip."""
    from importlib import metadata

    from packaging.requirements import Requirement

    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv",
                    "--without-pip", str(sim)], check=True, timeout=300)
    python = sim / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], capture_output=True, text=True,
                          check=True).stdout.strip()
    todo, seen = ["torch"], set()
    while todo:
        try:
            dist = metadata.distribution(todo.pop())
        except metadata.PackageNotFoundError:
            continue  # an optional requirement this torch build does not use
        name = dist.metadata["Name"].lower()
        if name in seen:
            continue
        seen.add(name)
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
        for top in {file.parts[0] for file in dist.files or []} - {".."}:
            link = os.path.join(site, top)
            if not os.path.lexists(link):
                os.symlink(dist.locate_file(top), link)
    return python, seen


@pytest.mark.slow
# The lent GPU machine runs Python 3.12 with megatron-core 0.19 (its wheels are built so).
@pytest.mark.one_release("0.19")
def test_cpu_smoke_on_a_simulated_gpu_machine_installs_offline_and_packs_the_report(tmp_path):
    """The acceptance run as the lent GPU machine runs it: wheels from `make gpu-wheels` for
    this Python and Megatron-Core, unpacked without pip or an index into a bare interpreter that
    has only torch; every step passes and at most six files come back."""
    from importlib import metadata

    mcore = metadata.version("megatron-core")
    python, present = _bare_python(tmp_path / "sim")
    assert "torch" in present and "megatron-core" not in present
    no_pip = subprocess.run([str(python), "-m", "pip", "--version"], capture_output=True)
    assert no_pip.returncode != 0
    wheels = tmp_path / "wheels"
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    made = subprocess.run(["make", "-s", "gpu-wheels", f"PYTHON={sys.executable}",
                           f"GPU_PYTHONS={version}", f"GPU_MCORE={mcore}",
                           f"GPU_WHEELS={wheels}"], cwd=ROOT, timeout=900, capture_output=True,
                          text=True)
    assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-2000:]
    out, report = tmp_path / "out", tmp_path / "report"
    command = ["bash", os.path.join(ROOT, "scripts", "gpu_acceptance.sh"), "--cpu-smoke",
               "--out", str(out), "--report-dir", str(report)]
    # Called from a distributed process (as from this test session's gloo group), the run must
    # not reuse the caller's rendezvous: advertise a port that is taken.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(taken.getsockname()[1]),
                   RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", PYTHON=str(python),
                   MEA_WHEELS=str(wheels), MEA_SITE=str(tmp_path / "site"),
                   PIP_NO_INDEX="1")
        env.pop("PYTHONPATH", None)
        env.pop("VIRTUAL_ENV", None)
        run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1200,
                             env=env)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-3000:]
    assert "[install]" in run.stdout and "megatron_core-" in run.stdout
    # What comes back: at most six files, the rest in one archive.
    assert sorted(os.listdir(out)) == ["acceptance.json", "console.log", "report.tar.gz",
                                       "summary.txt"]
    with tarfile.open(out / "report.tar.gz") as archive:
        packed = set(archive.getnames())
    assert {"gpu_tests.log", "gpu_tests.xml", "training.log", "decode.log",
            "bench_h64-local.log", "paged_kernel.log"} <= packed
    assert not any("data_cache" in name for name in packed)
    assert "[acceptance] training: ok" in (out / "console.log").read_text()
    result = json.loads((out / "acceptance.json").read_text())
    assert result["mode"] == "cpu-smoke" and result["ok"]
    steps = result["steps"]
    assert list(steps) == ["environment", "gpu_tests", "training", "decode_bench",
                           "paged_kernel", "megatron_lm", "layer_bench"]
    # megatron-core and megatron_mea came from the wheels, not from this venv.
    assert str(tmp_path / "site") in result["environment"]["megatron_core"]
    assert result["environment"]["megatron_core"].startswith(mcore)
    assert all(step["ok"] for name, step in steps.items()
               if name not in ("megatron_lm", "paged_kernel"))
    assert steps["megatron_lm"]["not_available"] and "megatron_lm" in result["skipped"]
    # The serving kernel runs tiny under Triton's interpreter where torch brings triton (a CUDA
    # build, as in the 0.19 leg's venv); a CPU build has none: then it is named as not available
    # (tests/vllm runs its CPU form), not dropped.
    kernel = steps["paged_kernel"]
    if importlib.util.find_spec("triton") is None:
        assert "triton does not import" in kernel["not_available"]
        assert "paged_kernel" in result["skipped"]
    else:
        assert kernel["ok"] and kernel["device"] == "cpu", kernel
        assert set(kernel["exact"]["float32"]) == {"one pass", "split-KV"}
        assert set(kernel["decode"]) == {"24"} and set(kernel["prefill"]) == {"12"}
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
    # Decoding: every variant at both contexts; MEA with half the components caches less.
    decode = steps["decode_bench"]["rows"]
    assert list(decode) == ["32", "64"]
    for rows in decode.values():
        assert set(rows) == {"baseline", "mea", "mea-half", "kha"}
        assert rows["baseline"]["kv_bytes_vs_base"] == 1.0
        assert rows["mea-half"]["kv_bytes_vs_base"] < 0.6
        assert all(r["decode_tokens_per_s"] > 0 for r in rows.values())
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
    assert "[SKIPPED] megatron_lm" in summary and "mea-half" in summary
    assert ("[ok] paged_kernel" in summary) != ("[SKIPPED] paged_kernel" in summary)


def test_without_cuda_and_without_smoke_it_refuses(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert acceptance.main(["--out", str(tmp_path)]) == 2


def test_wheel_choice_pins_ours_keeps_installed_others_and_fits_this_python(tmp_path):
    cp = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    other = "cp39" if cp != "cp39" else "cp310"
    for name in [
        f"megatron_core-0.16.1-{cp}-{cp}-manylinux_2_28_x86_64.whl",
        f"megatron_core-0.16.1-{other}-{other}-manylinux_2_28_x86_64.whl",
        "megatron_mea-0.1.0-py3-none-any.whl",
        "pytest-9.0.0-py3-none-any.whl",  # installed here: kept
        f"numpy-2.4.6-{cp}-{cp}-manylinux_2_28_x86_64.whl",  # installed here: kept
        "Surely_Absent.Pkg-1.0-py3-none-any.whl",
        "surely_absent_pkg-1.2-py3-none-any.whl",  # the newer of two that fit
        f"surely_absent_win-1.0-{cp}-{cp}-win_amd64.whl",  # another platform
        "notes.txt",
    ]:
        (tmp_path / name).write_text("")
    chosen = {w.name: os.path.basename(w.path) for w in install.wheels_to_install(str(tmp_path))}
    assert sorted(chosen) == ["megatron-core", "megatron-mea", "surely-absent-pkg"]
    assert chosen["megatron-core"].startswith(f"megatron_core-0.16.1-{cp}")
    assert chosen["surely-absent-pkg"] == "surely_absent_pkg-1.2-py3-none-any.whl"


def test_unpacking_a_wheel_installs_it_and_refuses_paths_outside(tmp_path):
    import zipfile

    wheel = tmp_path / "demo_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("demo_pkg/__init__.py", "VALUE = 7\n")
        archive.writestr("demo_pkg-1.0.dist-info/METADATA", "Name: demo-pkg\nVersion: 1.0\n")
        archive.writestr("demo_pkg-1.0.data/purelib/demo_extra.py", "EXTRA = 1\n")
        archive.writestr("demo_pkg-1.0.data/scripts/demo", "#!/bin/sh\n")
    site = tmp_path / "site"
    assert install.install_wheels(str(tmp_path), str(site)) == [wheel.name]
    run = subprocess.run([sys.executable, "-c", "import demo_pkg, demo_extra; "
                          "print(demo_pkg.VALUE + demo_extra.EXTRA)"],
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(site)))
    assert run.stdout.strip() == "8", run.stderr
    evil = tmp_path / "evil" / "evil_pkg-1.0-py3-none-any.whl"
    evil.parent.mkdir()
    with zipfile.ZipFile(evil, "w") as archive:
        archive.writestr("../escaped.py", "")
    with pytest.raises(ValueError, match="leaves the folder"):
        install.install_wheels(str(evil.parent), str(tmp_path / "site2"))
    assert not (tmp_path / "escaped.py").exists()


def test_pack_report_returns_at_most_four_files(tmp_path):
    from megatron_mea.apps.acceptance.pack import pack_report

    report = tmp_path / "report"
    report.mkdir()
    for name in ("summary.txt", "acceptance.json", "console.log", "a.log", "b.xml", "c.json"):
        (report / name).write_text(name)
    assert pack_report(str(report), str(tmp_path / "out")) == [
        "summary.txt", "acceptance.json", "console.log", "report.tar.gz"]
    with tarfile.open(tmp_path / "out" / "report.tar.gz") as archive:
        assert sorted(archive.getnames()) == ["a.log", "b.xml", "c.json"]


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H200", 989.4),
    ("NVIDIA GH200 480GB", 989.4), ("NVIDIA A100-SXM4-80GB", 312.0), ("Tesla T4", None),
    (None, None),
])
def test_peak_from_the_device_name(name, peak):
    assert environment.peak_bf16_tflops(name) == peak


def test_training_flops_agree_with_the_layer_benchmark():
    from argparse import Namespace

    from megatron_mea.apps.bench.steps import layer_flops

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
