"""Checkpoints of Megatron-LM's `pretrain_gpt.py` (layout: `tests/checkpoint/_megatron_lm.py`,
Megatron-LM's tag matching the installed megatron-core) export to Hugging Face with no
hand-written file: the description comes from the saved arguments (read safely), the logits
equal Megatron's, `generate` with the cache equals greedy decoding without it, and the export
imports back to the same tensors. One checkpoint per MoE form:

| form                                              | saved at  | HF class                        |
|---------------------------------------------------|-----------|---------------------------------|
| dense MEA, virtual heads (nc=1 < ng=2), head norm | TP=1      | MegatronMEALlamaForCausalLM     |
| standard, mixed dense/MoE, softmax after top-k    | TP=1      | Qwen3MoeForCausalLM (stock)     |
| MEA, mixed dense/MoE, softmax before top-k        | TP=2 + SP | MegatronMEAQwen3MoeForCausalLM  |
| KHA-MLP, sigmoid + expert bias, top-k scaling,    | TP=2 + SP | MegatronMEAQwen3MoeForCausalLM  |
|   shared expert, MoE every other layer            |           |   (MegatronRouter)              |
"""

import argparse
import os

import pytest
import torch

from megatron_mea.checkpoint.hf.exporting import export_hf_checkpoint
from megatron_mea.checkpoint.hf.importing import import_hf_checkpoint
from megatron_mea.checkpoint.torch_dist.layerwise import read_checkpoint
from megatron_mea.checkpoint.torch_dist.model_only import ConversionError, ModelDescription
from megatron_mea.checkpoint.megatron_lm.reading import (
    common_state_types,
    run_args_from_megatron_lm,
    read_common_state,
    safe_load,
)
from megatron_mea.integrations.mlm_flags import installed_tag
from tests._dist import run_distributed
from tests.checkpoint._megatron_lm import megatron_lm_args, save_megatron_lm_checkpoint

VOCAB = 100  # NullTokenizer: the model has VOCAB + 1 ids (its EOD), padded to 128
ATOL = 1e-4
VOCAB_TENSORS = ("word_embeddings.weight", "output_layer.weight")
BASE = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--seq-length", "16",
    "--max-position-embeddings", "16", "--swiglu",
    "--normalization", "RMSNorm", "--disable-bias-linear", "--position-embedding-type", "rope",
    "--untie-embeddings-and-output-weights", "--ffn-hidden-size", "96",
]
NULL_TOKENIZER = ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB)]
MOE = ["--qk-layernorm", "--num-experts", "4", "--moe-router-topk", "2",
       "--moe-ffn-hidden-size", "32"]
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
FORMS = {
    "dense_mea_virtual_heads": (
        1, ["--attention-variant", "mea", "--mea-num-kv-components", "1", "--mea-head-norm"],
        "MegatronMEALlamaForCausalLM",
    ),
    "mixed_softmax_stock": (
        1, MOE + ["--moe-layer-freq", "[0,1]"], "Qwen3MoeForCausalLM",
    ),
    # The KHA recipe's baseline: standard attention with the sigmoid router and expert bias.
    "baseline_sigmoid_expert_bias": (
        1, MOE + ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                  "--moe-router-load-balancing-type", "none"],
        "MegatronMEAQwen3MoeForCausalLM",
    ),
    # No QK norm: Mixtral cannot hold dense layers, so the native Qwen3-MoE without q/k norms.
    "mixed_no_qk_norm": (
        1, [flag for flag in MOE if flag != "--qk-layernorm"] + ["--moe-layer-freq", "[1,0]"],
        "MegatronMEAQwen3MoeForCausalLM",
    ),
    "mea_mixed_pre_softmax_tp2": (
        2, MOE + TP2 + ["--moe-layer-freq", "[0,1]", "--moe-router-pre-softmax",
                        "--attention-variant", "mea", "--mea-num-kv-components", "2"],
        "MegatronMEAQwen3MoeForCausalLM",
    ),
    "kha_mlp_sigmoid_expert_bias_tp2": (
        2, MOE + TP2 + ["--moe-layer-freq", "[1,0]", "--attention-variant", "kha",
                        "--kha-variant", "mlp", "--moe-router-score-function", "sigmoid",
                        "--moe-router-enable-expert-bias", "--moe-router-load-balancing-type",
                        "none", "--moe-router-topk-scaling-factor", "2.5",
                        "--moe-shared-expert-intermediate-size", "48"],
        "MegatronMEAQwen3MoeForCausalLM",
    ),
}


def ids(batch=2, seq=8, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=gen)


class Saved:
    """Megatron-LM checkpoints of the forms, written once per module."""

    def __init__(self, root):
        self.root, self.done = root, {}

    def __call__(self, form):
        if form not in self.done:
            world, argv, _ = FORMS[form]
            root = os.path.join(self.root, form)
            logits = run_distributed(save_megatron_lm_checkpoint, world,
                                     BASE + NULL_TOKENIZER + argv, installed_tag(), root,
                                     ids())[0]
            self.done[form] = (root, logits)
        return self.done[form]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return Saved(str(tmp_path_factory.mktemp("megatron_lm")))


def _load_hf(directory):
    import megatron_mea.integrations.transformers  # noqa: F401  (registers the native model types)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory).eval()


@pytest.mark.parametrize("form", sorted(FORMS))
def test_megatron_lm_checkpoint_exports_with_megatron_logits(saved, form, tmp_path, single_rank):
    root, logits = saved(form)
    assert not os.path.exists(os.path.join(root, "config.yaml"))  # nothing hand-written
    out = str(tmp_path / "hf")
    export_hf_checkpoint(root, out)
    model = _load_hf(out)
    assert type(model).__name__ == FORMS[form][2]
    batch = ids()
    with torch.no_grad():
        got = model(batch).logits.float()
    assert got.shape[-1] == VOCAB + 1
    diff = (got - logits[..., : VOCAB + 1]).abs().max().item()
    assert diff < ATOL, diff
    # HF generation with its cache is greedy decoding without it.
    with torch.no_grad():
        cached = model.generate(batch[:1, :4], max_new_tokens=6, do_sample=False, use_cache=True)
        plain = model.generate(batch[:1, :4], max_new_tokens=6, do_sample=False, use_cache=False)
    assert torch.equal(cached, plain)
    # The same form imports back to the same Megatron tensors.
    again = str(tmp_path / "again")
    import_hf_checkpoint(out, again)
    _, original = read_checkpoint(root)
    _, reimported = read_checkpoint(again)
    for (layer, want), (_, have) in zip(original, reimported, strict=True):
        assert sorted(want) == sorted(have), layer
        for name in want:
            # Megatron-LM's padding rows of the vocabulary are not exported (zeros again).
            rows = VOCAB + 1 if name.endswith(VOCAB_TENSORS) else None
            torch.testing.assert_close(have[name][:rows], want[name][:rows], atol=0, rtol=0,
                                       msg=name)


def test_the_expert_bias_is_a_checkpoint_tensor_that_routes(saved, tmp_path, single_rank):
    root, logits = saved("kha_mlp_sigmoid_expert_bias_tp2")
    out = str(tmp_path / "hf")
    export_hf_checkpoint(root, out)
    model = _load_hf(out)
    bias = model.model.layers[0].mlp.gate.expert_bias
    assert bias.abs().max() > 0.5  # the checkpoint's (moved) bias, not a zero init
    with torch.no_grad():
        bias.zero_()
        without = model(ids()).logits.float()
    assert (without - logits[..., : VOCAB + 1]).abs().max() > 1e-2


def test_description_reads_the_saved_arguments(saved, single_rank):
    root, _ = saved("kha_mlp_sigmoid_expert_bias_tp2")
    args = ModelDescription.load(root).args
    assert (args.attention_variant, args.kha_variant) == ("kha", "mlp")
    assert (args.moe_router_score_function, args.moe_router_enable_expert_bias) == ("sigmoid", True)
    assert args.moe_router_topk_scaling_factor == 2.5 and args.moe_layer_freq == [1, 0]
    assert args.moe_shared_expert_intermediate_size == 48
    # Megatron-LM pads to a multiple of make_vocab_size_divisible_by x TP (128 x 2).
    assert (args.vocab_size, args.padded_vocab_size) == (VOCAB + 1, 256)
    assert args.tensor_model_parallel_size == 2


def test_common_state_is_read_with_an_allow_list_only(saved, tmp_path):
    root, _ = saved("dense_mea_virtual_heads")
    state = read_common_state(os.path.join(root, "iter_0000005"))
    assert isinstance(state["args"], argparse.Namespace) and state["iteration"] == 5
    assert type(state["args"].attention_backend).__name__ == "AttnBackend"  # an inert stand-in
    path = tmp_path / "common.pt"
    torch.save({"args": argparse.Namespace(x=Unlisted())}, path)
    with pytest.raises(ConversionError, match="Unlisted"):
        with open(path, "rb") as handle:
            safe_load(handle)


class Unlisted:
    """A type no Megatron-LM namespace holds."""


@pytest.mark.parametrize("flag, value, name", [
    ("multi_latent_attention", True, "multi_latent_attention"),
    ("rotary_percent", 0.5, "rotary_percent"),
    ("moe_router_num_groups", 2, "moe_router_num_groups"),
    ("moe_shared_expert_gate", True, "moe_shared_expert_gate"),
    ("mtp_num_layers", 1, "mtp_num_layers"),
])
def test_what_cannot_be_described_is_refused_by_name(flag, value, name):
    args, _ = megatron_lm_args(BASE + NULL_TOKENIZER + MOE, 1, installed_tag())
    setattr(args, flag, value)
    with pytest.raises(ConversionError, match=rf"{name} \({value!r}\) cannot be converted"):
        run_args_from_megatron_lm(args, "ckpt")


def test_mea_generate_decodes_a_megatron_lm_checkpoint_as_its_export(tmp_path, single_rank):
    """A run with a Hugging Face tokenizer (Megatron-LM pads the tokenizer's 5 ids to 128 rows):
    `load_for_inference` (mea-generate) takes the checkpoint; greedy decoding gives the export's
    tokens and logits."""
    from tests.data.test_tokenizers import _save_tiny_hf_tokenizer
    from tests.inference import _workers
    from tests.inference.test_imported_checkpoint import _hf_logits_of

    tokenizer = str(tmp_path / "tokenizer")
    _save_tiny_hf_tokenizer(tokenizer)
    root = str(tmp_path / "run")
    argv = BASE + ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer,
                   "--attention-variant", "mea", "--mea-num-kv-components", "1"]
    run_distributed(save_megatron_lm_checkpoint, 1, argv, installed_tag(), root, ids())
    prompts = [ids(1, 6, seed=11)[0].tolist()]
    # The worker compares the rows below its vocabulary size (here all but the last).
    result = run_distributed(_workers.load_and_generate, 1, [(root, 1)], prompts, 4, 127)[0][0]
    out = str(tmp_path / "hf")
    export_hf_checkpoint(root, out)
    assert os.path.exists(os.path.join(out, "tokenizer.json"))  # the run's tokenizer travels
    model = _load_hf(out)
    with torch.no_grad():
        greedy = model.generate(torch.tensor(prompts), max_new_tokens=4, do_sample=False)
    assert greedy[0, 6:].tolist() == result["tokens"][0]
    for got, want in zip(result["logits"], _hf_logits_of(model, prompts, result["tokens"])):
        torch.testing.assert_close(got, want[:, :127], atol=ATOL, rtol=ATOL)


def test_the_allow_list_leaves_megatron_cores_own_safe_globals_in_place():
    # Megatron-Core allows argparse.Namespace process-wide at import; reading a Megatron-LM
    # common state must not take that back (our checkpoints hold Megatron-LM's arguments too).
    import megatron.core  # noqa: F401  (registers its safe globals)

    assert argparse.Namespace in torch.serialization.get_safe_globals()
    with common_state_types():
        pass
    assert argparse.Namespace in torch.serialization.get_safe_globals()
