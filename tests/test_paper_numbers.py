"""The papers' printed numbers, computed by this package from the papers' shapes.

Each expected value below is a number the paper prints (or the paper's own formula evaluated);
what is compared against it is computed by `megatron_mea.model.size` (the accounting behind
`mea-model-size`) or `megatron_mea.checkpoint.transforms.compress` (`mea-convert compress`), so
a change to the counting, the FLOP terms or the SVD makes these fail.

KHA = Zhou et al., "Knocking-Heads Attention", arXiv 2510.23052 v1; MEA = Peng, Zhou et al.,
"Explicit Multi-head Attention for Inter-head Interaction in LLMs", arXiv 2601.19611 v1.
"""

import dataclasses
import math

import pytest
import torch

from megatron_mea.checkpoint.transforms.compress import (
    compress_layer,
    compressed_description,
    select_layers,
)
from megatron_mea.checkpoint.torch_dist.model_only import ModelDescription
from megatron_mea.model.args import ModelArgs, RunArgs
from megatron_mea.model.size import (
    ModelShape,
    attention_params,
    kv_cache_elements,
    layer_forward_flops,
    model_size,
)
from megatron_mea.ops.functional import fold_head_mix
from megatron_mea.ops.qkv_layout import fuse_qkv, unfuse_qkv

# ---- KHA Section 3.4: FLOPs of one layer -------------------------------------------------------

# The paper's worked example: L = 2048 tokens, d = 1024, n = 32 heads of d_k = d / n, an MHA layer
# (g = n) and a SwiGLU FFN of d_ff = 3d. Eqs. 10-12 count 2 FLOPs per weight and token, forward
# only, and the full L x L scores (no causal halving): `layer_forward_flops(causal=False)`.
KHA_FLOP_EXAMPLE = dict(num_layers=1, hidden_size=1024, num_attention_heads=32, seq_length=2048,
                        ffn_hidden_size=3 * 1024, swiglu=True, num_experts=None, vocab_size=128,
                        qk_layernorm=False, attention_variant="kha")


@pytest.mark.parametrize("kha", [dict(kha_variant="linear", kha_targets=("q", "k", "v")),
                                 dict(kha_variant="mlp", kha_targets=("v",))],
                         ids=["linear-qkv", "mlp-v"])
def test_kha_section_3_4_flop_example(kha):
    shape = ModelShape(**KHA_FLOP_EXAMPLE, **kha)
    L, d, n = 2048, 1024, 32
    terms = {key: L * value for key, value in layer_forward_flops(shape, causal=False).items()}
    flop_mha = terms["projections"] + terms["attention"]
    flop_total = flop_mha + terms["mlp"]
    # Eqs. 10-12 as printed; the paper says eq. 12 holds for both variants.
    assert flop_mha == 8 * L * d**2 + 4 * L**2 * d == 34_359_738_368
    assert terms["mlp"] == 18 * L * d**2
    assert flop_total == 26 * L * d**2 + 4 * L**2 * d == 73_014_444_032
    assert terms["variant"] == 6 * L * d**2 // n == 402_653_184
    # "0.55 % of the layer, 1.17 % of MHA" (Section 3.4).
    assert round(100 * terms["variant"] / flop_total, 2) == 0.55
    assert round(100 * terms["variant"] / flop_mha, 2) == 1.17


def test_kha_flops_with_gqa_act_on_the_kv_heads_only():
    # Eq. 12 assumes MHA. With GQA our count applies T^V (or the V-MLP) to the g KV heads, before
    # they are repeated for the query heads (the same function: the map is per head): g/n of
    # eq. 12 for KHA-MLP on V, the paper's main setting (32 query heads, 4 KV heads).
    shape = ModelShape(**{**KHA_FLOP_EXAMPLE, "num_query_groups": 4}, kha_variant="mlp",
                       kha_targets=("v",), kv_channels=32)
    L, d, n, g = 2048, 1024, 32, 4
    assert L * layer_forward_flops(shape, causal=False)["variant"] == 6 * L * d**2 // n * g // n


def test_megatron_convention_halves_the_scores_and_triples_for_training():
    # `training_flops_per_token` is Megatron-LM's convention: causal scores (half of eq. 10's
    # 4 n L^2 d_k), forward + backward = 3 x forward, plus the output layer; the ratios of
    # Section 3.4 are per layer and forward only.
    shape = ModelShape(**KHA_FLOP_EXAMPLE, kha_variant="mlp", kha_targets=("v",))
    full = layer_forward_flops(shape, causal=False)
    causal = layer_forward_flops(shape)
    assert 2 * causal["attention"] == full["attention"]
    output_layer = 2 * 128 * 1024  # untied V x d, 2 FLOPs per weight
    assert model_size(shape)["training_flops_per_token"] == 3 * (sum(causal.values())
                                                                 + output_layer)


# ---- KHA Tables 3 and 5: parameter counts ------------------------------------------------------

# The counting rule (ours: the paper gives no formula; this one reproduces every
# MHA / GQA / MQA / GTA / dense row): no biases; q/k RMSNorm; two RMSNorms per layer and a final
# one; SwiGLU experts (3 d f each), k of E active; router d x E; no shared expert; a dense FFN
# 3 d d_ff; the embedding counted once, in total and activated, with V_eff = 157,184 rows (the
# paper states no vocabulary or tying; 157,184 lies in the range that fits every row, so the
# absolute counts check the rule, and the row differences, which do not involve V, check the
# attention terms); RoPE, which has no parameters (the paper's layers are Qwen3-style, Section
# 4.1; it never names RoPE). `mea-model-size` counts Megatron-LM's default learned positions
# unless `--position-embedding-type rope` is given: +4096 x 1536 = 6.3M (886.6M for the 880M row).
V_EFF = 157_184
PAPER_RULE = dict(vocab_size=V_EFF, untie_embeddings_and_output_weights=False, kv_channels=128,
                  normalization="RMSNorm", qk_layernorm=True, swiglu=True,
                  position_embedding_type="rope", add_bias_linear=False)
# Table 3's model and Table 5's middle MoE row: A0.8B-6.6B, 64 experts top-4.
A08B = dict(num_layers=18, hidden_size=1536, num_experts=64, moe_router_topk=4,
            moe_ffn_hidden_size=1152)


def _printed(value: float, printed: float, unit: float) -> bool:
    """Whether `printed` is `value` rounded or truncated to `unit`: the paper does both (0.4368B
    is printed 0.44B, 14.651B is printed 14.6B and 0.880B is the "A0.8B" model)."""
    return printed - unit / 2 <= value < printed + unit


def _moe(**kwargs) -> ModelShape:
    return ModelShape(**{**PAPER_RULE, **A08B, **kwargs})


TABLE_3 = [  # (attention, query heads, KV heads, activated parameters in M, cache)
    ("GQA", 16, 8, 795, 2048),
    ("GQA", 32, 4, 880, 1024),
    ("MQA", 32, 1, 859, 256),
    ("MHA", 16, 16, 852, 4096),
]


@pytest.mark.parametrize("name,np_,ng,activated,cache", TABLE_3,
                         ids=[f"{row[0]}-{row[2]}kv-{row[1]}q" for row in TABLE_3])
def test_kha_table_3_activated_parameters_and_cache(name, np_, ng, activated, cache):
    shape = _moe(num_attention_heads=np_, num_query_groups=ng)
    size = model_size(shape)
    assert _printed(size["active_params"] / 1e6, activated, 1), size["active_params"]
    # "Cache": K and V elements per token and layer.
    assert kv_cache_elements(shape) == cache
    # Row differences from the 880M GQA row: only the attention weights differ (85.0M, 21.2M,
    # 28.3M for the 795M, 859M and 852M rows).
    reference = model_size(_moe(num_attention_heads=32, num_query_groups=4))["active_params"]
    attention = {
        key: 18 * attention_params(_moe(num_attention_heads=h, num_query_groups=g))["matmul"]
        for key, h, g in (("row", np_, ng), ("gqa4", 32, 4))
    }
    assert reference - size["active_params"] == attention["gqa4"] - attention["row"]
    assert _printed((reference - size["active_params"]) / 1e6, 880 - activated, 1)


def test_kha_table_3_gta_row():
    # This package builds no GTA layer. The rule's GTA attention: the GQA-4/32 layer with its K
    # and V projections (d x 2 x 4 x 128) replaced by one tied KV projection (d x 512) and a RoPE
    # key projection (d x 64), the "512+64" of the cache column.
    gqa = _moe(num_attention_heads=32, num_query_groups=4)
    gta = model_size(gqa)["active_params"] - 18 * 1536 * (2 * 4 * 128 - (512 + 64))
    assert _printed(gta / 1e6, 868, 1), gta


TABLE_5 = [  # (layers, hidden, FFN or expert size, experts or None (dense), activated B, total B)
    (12, 1152, 768, 64, 0.44, 2.3),
    (18, 1536, 1152, 64, 0.8, 6.6),
    (23, 2048, 1536, 64, 1.6, 14.6),
    (24, 1024, 3072, None, 0.61, 0.61),
    (24, 2048, 6144, None, 1.68, 1.68),
    (36, 2560, 9728, None, 3.94, 3.94),
]


def _table_5_shape(layers, hidden, ffn, experts, **variant) -> ModelShape:
    sizes = (dict(num_experts=experts, moe_router_topk=4, moe_ffn_hidden_size=ffn) if experts
             else dict(num_experts=None, ffn_hidden_size=ffn))
    # GQA with 32 query heads and 4 KV heads of 128 in every row (32 x 128 > d for d = 1024).
    return ModelShape(**PAPER_RULE, num_layers=layers, hidden_size=hidden,
                      num_attention_heads=32, num_query_groups=4, **sizes, **variant)


@pytest.mark.parametrize("layers,hidden,ffn,experts,activated,total", TABLE_5,
                         ids=[f"{'moe' if r[3] else 'dense'}-{r[0]}x{r[1]}" for r in TABLE_5])
def test_kha_table_5_totals_and_activated(layers, hidden, ffn, experts, activated, total):
    size = model_size(_table_5_shape(layers, hidden, ffn, experts))
    unit = lambda printed: 10.0 ** -len(repr(printed).split(".")[1])  # noqa: E731
    assert _printed(size["total_params"] / 1e9, total, unit(total)), size["total_params"]
    assert _printed(size["active_params"] / 1e9, activated, unit(activated)), size["active_params"]
    # "Less than 1 % additional parameters" (Section 1), for both variants.
    for variant in (dict(kha_variant="mlp", kha_targets=("v",)),
                    dict(kha_variant="linear", kha_targets=("q", "k", "v"))):
        kha = model_size(_table_5_shape(layers, hidden, ffn, experts, attention_variant="kha",
                                        **variant))
        assert kha["active_params"] - size["active_params"] == layers * 3 * 128 * 128
        assert kha["active_params"] < 1.01 * size["active_params"]


def test_kha_main_model_shape_is_a_guess_that_fits_the_printed_size():
    # Section 4.1 gives only 128 experts top-8, 32 query / 4 KV heads, 6.1B total and 1.01B
    # activated. Under the rule above, d = 2048, 18 layers and experts of 384 fit (a shape that
    # does, not one the paper confirms); examples/megatron_lm/kha_moe_6b_a1b.sh uses another guess
    # (tests/integrations/test_model_size.py holds it within 2 %).
    shape = ModelShape(**PAPER_RULE, num_layers=18, hidden_size=2048, num_attention_heads=32,
                       num_query_groups=4, num_experts=128, moe_router_topk=8,
                       moe_ffn_hidden_size=384)
    size = model_size(shape)
    assert _printed(size["total_params"] / 1e9, 6.1, 0.1)
    assert _printed(size["active_params"] / 1e9, 1.01, 0.01)


# ---- MEA Appendix F: SVD virtual heads on Qwen3-30B-A3B ---------------------------------------

# Qwen3-30B-A3B's attention (its public config; MEA Section 5.2 compresses it): 48 layers, hidden
# 2048, 32 query heads, 4 KV heads of 128, q/k RMSNorm.
QWEN3_30B_A3B = dict(num_layers=48, hidden_size=2048, num_attention_heads=32, num_query_groups=4,
                     kv_channels=128, qk_layernorm=True, num_experts=128, moe_router_topk=8,
                     moe_ffn_hidden_size=768, vocab_size=151936, add_bias_linear=False)


def _description(**fields) -> ModelDescription:
    return ModelDescription(RunArgs(**{**QWEN3_30B_A3B, **fields}))


def test_mea_appendix_f_svd_is_exact_at_h_prime_h_and_drops_the_discarded_energy():
    # One attention layer with Qwen3-30B-A3B's heads and random weights (Dim = 64 instead of
    # 2048 keeps it fast; the properties hold for any Dim >= H). Appendix F: W^K in
    # R^{Dim x H d_k} reshaped to (d_k Dim) x H, one column per head; its SVD, the top H' kept,
    # Lambda folded into W_lc.
    config = _description(num_layers=1, hidden_size=64).config
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(heads, 128, 64, generator=generator) / 8 for heads in (32, 4, 4))
    prefix = "decoder.layers.0.self_attention."
    tensors = {prefix + "linear_qkv.weight": fuse_qkv(q, k, v)}
    singular = {kind: torch.linalg.svdvals(heads.reshape(4, -1).T.double())  # [(d_k Dim), H]
                for kind, heads in (("key", k), ("value", v))}
    for h_prime in (4, 2, 1):
        out = compress_layer(tensors, 0, config, h_prime)
        parts = unfuse_qkv(out[prefix + "linear_qkv.weight"].double(), 32, h_prime, 128)
        # The queries are not touched.
        assert torch.equal(parts[0], q.double())
        for kind, components, original in (("key", parts[1], k), ("value", parts[2], v)):
            mix = out[prefix + f"head_mix.{kind}_weight"].double()
            assert mix.shape == (h_prime, 4)
            dropped = float(((fold_head_mix(components, mix) - original.double()) ** 2).sum())
            energy = singular[kind] ** 2
            if h_prime == 4:  # exact at H' = H (full column rank)
                assert dropped < 1e-9 * float(energy.sum())
            else:  # Eckart-Young: the sum of the discarded squared singular values
                assert dropped == pytest.approx(float(energy[h_prime:].sum()), rel=1e-4)


COMPRESSION = [  # (setting, layer selection, KV values per token the paper's count gives)
    ("Full", "all", 48, 24_576),
    ("Half", "paper-half", 24, 36_864),
    ("Deep", "all-but-first-3", 45, 26_112),
]


@pytest.mark.parametrize("setting,selection,compressed,paper_values", COMPRESSION,
                         ids=[row[0] for row in COMPRESSION])
def test_mea_qwen3_compression_geometry(setting, selection, compressed, paper_values):
    # Section 5.2.1: in every compressed layer 4 KV heads become 2 virtual (component) heads.
    # Full: all 48 layers; Half: layers 12-35 (Hugging Face 11-34); Deep: all but the first 3.
    layers = select_layers(selection, 48)
    assert len(layers) == compressed
    assert setting != "Half" or layers == list(range(11, 35))
    baseline = ModelShape(**QWEN3_30B_A3B)
    assert sum(kv_cache_elements(baseline, n) for n in range(48)) == 2 * 48 * 4 * 128 == 49_152
    for k_norm in (False, True):
        target = compressed_description(_description(qk_layernorm=k_norm), 2, layers=layers)
        shape = ModelShape(**{f.name: getattr(target.args, f.name)
                              for f in dataclasses.fields(ModelArgs)})
        values = sum(kv_cache_elements(shape, n) for n in range(48))
        # The paper's count: K and V of the cached heads. Qwen3's k RMSNorm acts on each
        # composite key after the mix, so our component cache also keeps the inverse RMS of each
        # of the 4 composite keys per token and compressed layer (docs/math.md); the paper does
        # not say how it treats the k norm.
        assert values == paper_values + (4 * compressed if k_norm else 0)
    share = {"Full": 0.5, "Half": 0.75, "Deep": 0.53125}[setting]
    assert math.isclose(paper_values / 49_152, share)
