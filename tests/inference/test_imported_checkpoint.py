"""Generation from a Hugging Face import: a 1001-token Llama 3.x (llama3 RoPE scaling) imported
at TP=2 loads at TP=2 and TP=1 and decodes transformers' logits on the real vocabulary; a
checkpoint whose padding TP cannot split loads with more padding; what cannot load at a TP size
is refused before any process group, and `mea-generate` says so in one line."""

import os
import subprocess
import sys

import pytest
import torch

from megatron_mea.checkpoint.hf.importing import import_hf_checkpoint
from megatron_mea.inference import load_for_inference
from tests._dist import run_distributed
from tests.checkpoint._hf_models import LLAMA3, build_hf_model, save_hf_model
from tests.inference import _workers

pytestmark = pytest.mark.slow

VOCAB = 1001  # odd: no TP size > 1 divides it
NEW_TOKENS = 4


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    """(HF model, import at TP=2 with the default padding, import with no padding at TP=1)."""
    root = tmp_path_factory.mktemp("imported")
    model = build_hf_model("llama", vocab_size=VOCAB, **LLAMA3)
    hf_dir = save_hf_model(model, str(root / "hf"))
    padded, unpadded = str(root / "padded"), str(root / "unpadded")
    import_hf_checkpoint(hf_dir, padded, parallel={"tensor_model_parallel_size": 2})
    import_hf_checkpoint(hf_dir, unpadded, make_vocab_size_divisible_by=1)
    return model, padded, unpadded


def _hf_logits_of(model, prompts, generated):
    """transformers' logits at the positions that chose each generated token, per prompt."""
    out = []
    with torch.no_grad():
        for prompt, tokens in zip(prompts, generated):
            logits = model(torch.tensor([prompt + tokens])).logits[0].float()
            out.append(logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)])
    return out


def test_imported_checkpoint_decodes_the_hf_logits_at_tp2_and_tp1(llama3):
    model, padded, unpadded = llama3
    gen = torch.Generator().manual_seed(7)
    # Long prompts: the llama3-scaled RoPE frequencies matter at these positions.
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (120, 100)]
    runs = [(padded, 2), (padded, 1), (unpadded, 2)]
    results = run_distributed(_workers.load_and_generate, 2, runs, prompts, NEW_TOKENS, VOCAB)
    assert [r["tokens"] for r in results[0]] == [r["tokens"] for r in results[1]]
    expected = _hf_logits_of(model, prompts, results[0][1]["tokens"])
    # 1001 rows padded to 1024 at import; the unpadded checkpoint to 1002 at TP=2.
    for (root, tp), result, rows in zip(runs, results[0], (1024, 1024, 1002), strict=True):
        assert result["rows"] == rows, (root, tp)
        assert result["padding"] == 0.0, (root, tp)  # zero rows: logit 0, masked in sampling
        assert result["tokens"] == results[0][1]["tokens"], (root, tp)
        for got, want in zip(result["logits"], expected, strict=True):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.fixture
def tiny(tmp_path, single_rank):
    """Import a tiny Llama with `overrides` under tmp_path; returns its root."""

    def make(name, **overrides):
        hf_dir = save_hf_model(build_hf_model("llama", **overrides), str(tmp_path / name / "hf"))
        root = str(tmp_path / name / "meg")
        import_hf_checkpoint(hf_dir, root)
        return root

    return make


def test_sizes_tp_cannot_split_are_refused_before_any_process_group(tiny):
    # Checked before the world size (1 here): the model itself cannot take this TP.
    with pytest.raises(ValueError, match=r"^ffn_hidden_size \(100\) must be divisible by the "
                                         r"tensor-parallel size \(8\)$"):
        load_for_inference(tiny("ffn", vocab_size=300, intermediate_size=100), 8)
    with pytest.raises(ValueError, match=r"^the tokenizer \(ByteLevelTokenizer\) has 257 ids, "
                                         r"more than the model's vocab_size \(96\)$"):
        load_for_inference(tiny("small_vocab"), 1)


def test_mea_generate_refuses_a_tp_size_in_one_line(tiny):
    root = tiny("heads", vocab_size=300)  # 8 query heads, 4 K/V heads
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    done = subprocess.run(
        [sys.executable, "-m", "megatron_mea.cli.generate", "--load", root, "--tp", "3",
         "--prompt", "hello"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert errors == [
        "mea-generate: error: num_attention_heads (8) must be a multiple of "
        "tensor_model_parallel_size (3)."
    ], done.stderr
