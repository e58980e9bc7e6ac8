"""`megatron_mea.model.size` and `mea-model-size`: parameter counts, FLOPs and KV-cache bytes
for baseline / MEA / KHA."""

import json

import pytest

from megatron_mea.model.size import ModelShape, model_size

# The KHA paper's main model as in examples/megatron_lm/kha_moe_6b_a1b.sh.
KHA_6B = dict(num_layers=24, hidden_size=1408, num_attention_heads=32, num_query_groups=4,
              kv_channels=128, vocab_size=128256, seq_length=8192, qk_layernorm=True,
              num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=416)


@pytest.mark.parametrize("variant", [dict(), dict(attention_variant="kha"),
                                     dict(attention_variant="mea")], ids=["baseline", "kha", "mea"])
def test_6b_example_is_within_2_percent_of_6_1b_total_and_1_01b_active(variant):
    size = model_size(ModelShape(**KHA_6B, **variant))
    assert size["total_params"] == pytest.approx(6.1e9, rel=0.02)
    assert size["active_params"] == pytest.approx(1.01e9, rel=0.02)


@pytest.mark.parametrize("nc", [1, 2, 4])
def test_mea_virtual_heads_cache_nc_over_ng_of_the_baseline_plus_the_key_scales(nc):
    base = model_size(ModelShape(**KHA_6B))["kv_cache_bytes_per_token"]
    mea = model_size(ModelShape(**KHA_6B, attention_variant="mea", mea_num_kv_components=nc))
    assert base == 2 * 24 * 4 * 128 * 2
    # With the RMS k norm (qk_layernorm) the component cache also holds one inverse RMS per
    # composite key (ng = 4) and token, in the cache dtype; nc == ng caches the composites.
    scales = 24 * 4 * 2 if nc < 4 else 0
    assert mea["kv_cache_bytes_per_token"] * 4 == base * nc + 4 * scales
    no_norm = model_size(ModelShape(**{**KHA_6B, "qk_layernorm": False}, attention_variant="mea",
                                    mea_num_kv_components=nc))
    assert no_norm["kv_cache_bytes_per_token"] * 4 == base * nc  # exactly nc/ng without it
    layer_norm = model_size(ModelShape(**KHA_6B, normalization="LayerNorm",
                                       attention_variant="mea", mea_num_kv_components=nc))
    assert layer_norm["kv_cache_bytes_per_token"] == base  # the composites are cached


def test_qwen3_30b_a3b_two_components_cut_the_cache_by_49_6_percent():
    # 48 layers, 4 KV heads of 128 with the RMS k norm: (2*2*128 + 4) / (2*4*128) = 0.504.
    shape = dict(num_layers=48, hidden_size=2048, num_attention_heads=32, num_query_groups=4,
                 kv_channels=128, vocab_size=151936, qk_layernorm=True, num_experts=128,
                 moe_router_topk=8, moe_ffn_hidden_size=768)
    base = model_size(ModelShape(**shape))["kv_cache_bytes_per_token"]
    mea = model_size(ModelShape(**shape, attention_variant="mea", mea_num_kv_components=2))
    assert round(100 * (mea["kv_cache_bytes_per_token"] / base - 1), 1) == -49.6


def test_variant_parameter_overheads_match_the_papers():
    hn, L, np_, ng = 128, 24, 32, 4
    base = model_size(ModelShape(**KHA_6B))["total_params"]
    kha_mlp = model_size(ModelShape(**KHA_6B, attention_variant="kha"))["total_params"]
    kha_lin = model_size(ModelShape(**KHA_6B, attention_variant="kha", kha_variant="linear",
                                    kha_targets=("q", "k")))["total_params"]
    mea = model_size(ModelShape(**KHA_6B, attention_variant="mea"))["total_params"]
    assert kha_mlp - base == L * 3 * hn * hn
    assert kha_lin - base == L * 2 * hn * hn
    assert mea - base == L * (2 * ng * ng + np_ * hn)
    # The KHA paper's ablations: the MLP on q, k and v; the gate alone on v.
    mlp_qkv = ModelShape(**KHA_6B, attention_variant="kha", kha_targets=("q", "k", "v"))
    gate = ModelShape(**KHA_6B, attention_variant="kha", kha_variant="gate")
    assert model_size(mlp_qkv)["total_params"] - base == L * 9 * hn * hn
    assert model_size(gate)["total_params"] - base == L * hn * hn
    flops = model_size(mlp_qkv)["training_flops_per_token"] - model_size(
        ModelShape(**KHA_6B))["training_flops_per_token"]
    assert flops == 3 * L * 3 * 2 * hn * hn * (np_ + 2 * ng)  # 3 (fwd+bwd) x 3 matrices per head


def test_llama_3_2_1b_shape_has_its_published_size():
    # Llama-3.2-1B: 1,235,814,400 parameters with tied embeddings.
    shape = ModelShape(num_layers=16, hidden_size=2048, ffn_hidden_size=8192,
                       num_attention_heads=32, num_query_groups=8, kv_channels=64,
                       vocab_size=128256, untie_embeddings_and_output_weights=False,
                       qk_layernorm=False, num_experts=None)
    assert model_size(shape)["total_params"] == 1_235_814_400


def test_dense_training_flops_follow_6n_plus_causal_attention():
    shape = ModelShape(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128,
                       seq_length=32, swiglu=False, qk_layernorm=False,
                       num_experts=None)
    matmul = 2 * (4 * 64 * 64 + 2 * 64 * 256) + 128 * 64  # attention + MLP per layer, output
    attention = 6 * 2 * 32 * 4 * 16  # 3 * L * (QK^T + AV: 2 * 2 * s * np * hn) / 2 (causal)
    assert model_size(shape)["training_flops_per_token"] == 6 * matmul + attention


def test_cli_takes_launch_flags(capsys):
    from megatron_mea.cli.model_size import main

    code = main(
        ["--json", "--num-layers", "24", "--hidden-size", "1408", "--num-attention-heads", "32",
         "--group-query-attention", "--num-query-groups", "4", "--kv-channels", "128", "--swiglu",
         "--num-experts", "128", "--moe-router-topk", "8", "--moe-ffn-hidden-size", "416",
         "--qk-layernorm", "--normalization", "RMSNorm", "--untie-embeddings-and-output-weights",
         "--seq-length", "8192", "--vocab-size", "128256", "--attention-variant", "mea",
         "--mea-num-kv-components", "2", "--disable-bias-linear", "--position-embedding-type",
         "rope"]
    )
    size = json.loads(capsys.readouterr().out)
    assert code == 0 and size["kv_cache_bytes_per_token"] == 24576 + 24 * 4 * 2
    expected = ModelShape(**KHA_6B, attention_variant="mea", mea_num_kv_components=2)
    assert size == model_size(expected)


def test_cli_counts_learned_positions_unless_rope_is_named(capsys):
    # KHA Table 3's 880M GQA row (tests/test_paper_numbers.py) from launch flags: Megatron-LM's
    # default --position-embedding-type is learned_absolute, which adds seq_length x hidden
    # parameters (886.6M); the paper's Qwen3-style layers use RoPE, which has none (880.3M).
    from megatron_mea.cli.model_size import main

    flags = ["--num-layers", "18", "--hidden-size", "1536", "--num-attention-heads", "32",
             "--group-query-attention", "--num-query-groups", "4", "--kv-channels", "128",
             "--swiglu", "--num-experts", "64", "--moe-router-topk", "4",
             "--moe-ffn-hidden-size", "1152", "--qk-layernorm", "--normalization", "RMSNorm",
             "--disable-bias-linear", "--seq-length", "4096", "--vocab-size", "157184"]
    active = {}
    for positions in ([], ["--position-embedding-type", "rope"]):
        assert main(flags + positions) == 0
        out = capsys.readouterr().out
        count = out.split("active parameters:")[1].split()[0]
        active[bool(positions)] = int(count.replace(",", ""))
        assert ("of which learned positions: 6,291,456" in out) == (not positions)
    assert round(active[True] / 1e6, 1) == 880.3
    assert active[False] - active[True] == 4096 * 1536
    assert round(active[False] / 1e6, 1) == 886.6


@pytest.mark.parametrize("fields", [
    dict(),
    dict(position_embedding_type="learned_absolute", max_position_embeddings=96,
         normalization="LayerNorm", add_bias_linear=True, untie_embeddings_and_output_weights=False),
    dict(attention_variant="mea", mea_num_kv_components=2),
    dict(attention_variant="kha", kha_variant="mlp", kha_targets=("q", "v"), num_experts=None),
    dict(attention_variant="kha", kha_variant="linear", moe_shared_expert_intermediate_size=48,
         moe_layer_freq=[1, 0]),
], ids=["baseline-moe", "learned-positions-layernorm-biases-tied", "mea-nc2", "kha-mlp-dense",
        "kha-linear-shared-expert"])
def test_total_is_what_megatron_builds(single_rank, fields):
    # The count the paper tests compare against is the parameters of the GPTModel Megatron-Core
    # builds from the same description (the checkpoint's tensors).
    from megatron_mea.model.args import MODEL_FIELDS, RunArgs
    from megatron_mea.model.gpt import build_model, transformer_config

    args = RunArgs(**{**dict(num_layers=2, hidden_size=64, num_attention_heads=8,
                             num_query_groups=4, seq_length=64, vocab_size=300, num_experts=4,
                             moe_ffn_hidden_size=32), **fields})
    model = build_model(args, transformer_config(args), pre_process=True, post_process=True)
    built = sum(p.numel() for p in model.parameters())
    # ModelShape counts the padded vocabulary (the embedding's rows).
    shape = ModelShape(**{**{name: getattr(args, name) for name in MODEL_FIELDS},
                          "vocab_size": args.padded_vocab_size})
    assert model_size(shape)["total_params"] == built
