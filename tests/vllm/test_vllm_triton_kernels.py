"""The Triton kernels of MEA's scaled-components cache (what the backend runs on CUDA), under
Triton's interpreter on the CPU in fp32, against torch: the package's scale-group kernel
(`megatron_mea.ops.paged_attention`) and vLLM's own `unified_attention` on stride-0 views of the
cache (`integrations/vllm/triton_attention.py`), each against the torch attention over the
component cache with the scales (`ops.decode.component_attention`, the plugin's torch math) and
attention over the composite heads.

Batches (`tests/vllm/_triton_interpret.py`): a decode step, a chunk after cached tokens and a
first prefill in one batch with padding, on 4-token blocks scattered over the pool; a decode-only
step on 16-token blocks through the split-KV form; the backend's impl on both, its CUDA code
(`forward_triton`) against its CPU path. One process of its own runs them all, with
`TRITON_INTERPRET=1` set there only (triton reads it when a kernel module is imported).
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOLERANCE = 2e-6  # fp32; measured 1.5e-7 to 7.2e-7


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    out = tmp_path_factory.mktemp("triton") / "kernels.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-m", "tests.vllm._triton_interpret", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    with open(out, encoding="utf-8") as handle:
        return json.load(handle)


@pytest.mark.parametrize("batch", ["mixed", "decode"])
def test_scale_group_kernel_equals_the_torch_path_and_the_composite_heads(interpreted, batch):
    row = interpreted[batch]["scale_group"]
    assert row["finite"]
    assert row["vs_torch"] <= TOLERANCE and row["vs_composite"] <= TOLERANCE, row
    assert row["padding_untouched"]
    assert row["split_kv"] == (batch == "decode")


@pytest.mark.parametrize("batch", ["mixed", "decode"])
def test_vllm_unified_attention_on_strided_views_equals_the_torch_path(interpreted, batch):
    row = interpreted[batch]["stock"]
    assert row["finite"]
    assert row["vs_torch"] <= TOLERANCE and row["vs_composite"] <= TOLERANCE, row
    assert row["split_kv"] == (batch == "decode")
    if batch == "mixed":  # vLLM's split-KV reduction writes the padding rows too
        assert row["padding_untouched"]


@pytest.mark.parametrize("batch", ["mixed", "decode"])
def test_the_backends_cuda_path_equals_its_cpu_path(interpreted, batch):
    """`ScaledComponentsImpl.forward_triton` (what `forward` runs on CUDA: the queries mixed,
    the kernel, the outputs mixed with A_v) against `forward` on the CPU (batched decodes,
    vLLM's C++ prefill over rebuilt composites), on what the layer hands the impl."""
    row = interpreted[batch]["impl"]
    assert row["vs_torch"] <= TOLERANCE and row["vs_composite"] <= TOLERANCE, row
    assert row["torch_vs_composite"] <= TOLERANCE, row


def test_the_gpu_acceptance_kernel_step_runs_in_its_cpu_form(interpreted):
    """`apps/acceptance/paged_kernel.py --smoke` (the GPU acceptance's kernel check; the acceptance's
    own CPU smoke has no triton and reports it as not available): exact, and every timing."""
    record = interpreted["acceptance_smoke"]
    assert record["ok"] and record["exact"]["float32"]["ok"]
    assert set(record["exact"]["float32"]) >= {"one pass", "split-KV"}
    for kind in ("decode", "prefill"):
        for row in record[kind].values():
            assert row["mea_kernel_ms"] > 0 and row["original_kernel_ms"] > 0
            assert row["original_sdpa_ms"] > 0 and row["kv_bytes_per_token_vs_original"] < 0.6
