"""vLLM serves every variant's native export (the plugin, found through its entry point) with the
Hugging Face model's greedy tokens, and MEA with virtual heads in a smaller KV cache (with an RMS
k norm too: the scaled-components cache, `test_vllm_scaled_cache.py`).

Run by `make test-vllm` in the vLLM venv: the exports are made first by `tests.vllm.make_exports`
in the main venv (directory `$MEA_VLLM_EXPORTS`). vLLM serves them all in one subprocess
(`tests.vllm._serve`; its engine spawns and keeps process-wide state), once per TP size.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.vllm.cases import CASES

EXPORTS = os.environ.get("MEA_VLLM_EXPORTS", "runs/vllm_exports")
PROMPTS = [[5, 17, 33, 2, 90, 64, 11], [100, 3, 3, 47, 120, 8, 77, 21, 9, 54, 6], [42]]
MAX_TOKENS = 8
ENV = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
           HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
           VLLM_ENABLE_V1_MULTIPROCESSING="0",
           # `_serve` sends its KV-cache probe (a function of its own) to the workers.
           VLLM_ALLOW_INSECURE_SERIALIZATION="1")
# Served at TP=2 too: the component cache (replicated components, split query heads and head
# norm), the scaled-components cache (each rank the scales of its composite keys), and KHA with
# the fused MoE split over the ranks.
TP2_CASES = ("qwen2-mea-nc2-norm", "qwen3-mea-nc2", "qwen3_moe-kha-mlp")


def export_dir(name):
    path = os.path.join(EXPORTS, name)
    if not os.path.exists(os.path.join(path, "config.json")):
        raise FileNotFoundError(
            f"{path}: no export; make them with `.venv/bin/python -m tests.vllm.make_exports "
            f"{EXPORTS}` (make test-vllm does)")
    return path


def serve(names, out, tp=1, prompts=PROMPTS, llm_args=None, rounds=1):
    """{export name: report} of vLLM serving the exports `names` (`tests.vllm._serve`)."""
    command = [sys.executable, "-m", "tests.vllm._serve", str(out),
               *[export_dir(name) for name in names], "--prompts", json.dumps(prompts),
               "--max-tokens", str(MAX_TOKENS), "--tp", str(tp),
               "--llm-args", json.dumps(llm_args or {}), "--rounds", str(rounds)]
    done = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise AssertionError(f"vLLM failed (exit {done.returncode}):\n"
                             f"{done.stdout[-3000:]}\n{done.stderr[-8000:]}")
    with open(out, encoding="utf-8") as handle:
        return json.load(handle)


@pytest.fixture(scope="session")
def served(tmp_path_factory):
    return serve([case.name for case in CASES], tmp_path_factory.mktemp("vllm") / "tp1.json")


@pytest.fixture(scope="session")
def served_tp2(tmp_path_factory):
    return serve(TP2_CASES, tmp_path_factory.mktemp("vllm") / "tp2.json", tp=2)


def hf_greedy(name, prompts=PROMPTS, max_tokens=MAX_TOKENS):
    """Greedy tokens of the Hugging Face model (full recompute each step, no cache)."""
    from transformers import AutoModelForCausalLM

    import megatron_mea.integrations.transformers  # noqa: F401  (the native model types)

    model = AutoModelForCausalLM.from_pretrained(export_dir(name), dtype=torch.float32).eval()
    tokens = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            for _ in range(max_tokens):
                ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
            tokens.append(ids[0, len(prompt):].tolist())
    return tokens


def kv_bytes_per_token(report):
    """KV-cache bytes per token, all layers (and TP ranks) together."""
    return sum(total / slots for total, slots in report["kv_cache"])


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_vllm_generates_the_hugging_face_greedy_tokens(served, case):
    assert served[case.name]["tokens"] == hf_greedy(case.name)


@pytest.mark.parametrize("name", TP2_CASES)
def test_vllm_at_tp2_generates_the_hugging_face_greedy_tokens(served_tp2, name):
    assert served_tp2[name]["tokens"] == hf_greedy(name)


def test_mea_virtual_heads_cache_half_the_baseline_bytes(served):
    ratio = kv_bytes_per_token(served["llama-mea-nc2"]) / kv_bytes_per_token(
        served["llama-baseline"])
    assert ratio <= 0.55, ratio
    assert not served["llama-mea-nc2"]["warnings"]


def test_mea_with_a_k_norm_holds_1_85x_the_baseline_tokens(served):
    # Head size 64, nc = ng/2: the components and ng scales, (2*nc*hn + ng) / (2*ng*hn) =
    # 260/512 of the baseline's bytes per token, so vLLM's pool holds 1.97x the tokens.
    mea, baseline = served["qwen3-mea-nc2"], served["qwen3-baseline"]
    (_, mea_tokens), = mea["kv_cache"]
    (_, baseline_tokens), = baseline["kv_cache"]
    assert mea_tokens / baseline_tokens >= 1.85, (mea_tokens, baseline_tokens)
    assert not mea["warnings"]


def test_mea_with_the_k_norm_before_the_mix_caches_half_the_baseline_bytes(served):
    mea = served["qwen3-mea-nc2-norm-before-mix"]
    ratio = kv_bytes_per_token(mea) / kv_bytes_per_token(served["qwen3-baseline"])
    assert ratio <= 0.55, ratio
    assert not mea["warnings"]
