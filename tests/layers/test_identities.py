"""Whole-model identities on a MoE GPT (RoPE, qk_layernorm): the variants at init are the plain
model, and their linear parts fold into plain Q/K/V projection weights."""

import re

import pytest
import torch

from megatron_mea.checkpoint.transforms.fold import fold_head_mix, fold_kha_linear
from megatron_mea.ops.qkv_layout import fuse_qkv, unfuse_qkv
from tests._models import batch, build_gpt, perturb_plugin_params, tiny_config

PLUGIN_KEY = re.compile(r"\.(head_mix|head_norm|knock)\.")


def logits(model):
    tokens, _ = batch()
    position_ids = torch.arange(tokens.shape[1]).expand_as(tokens)
    return model(tokens, position_ids, attention_mask=None)


def plain_state(variant_model, fold_layer=None):
    """The variant's state dict without plugin params; `fold_layer(prefix, state)` may rewrite
    each layer's `linear_qkv.weight`."""
    state = {
        k: v.clone() if torch.is_tensor(v) else v
        for k, v in variant_model.state_dict().items()
        if not PLUGIN_KEY.search(k)
    }
    if fold_layer is not None:
        full = variant_model.state_dict()
        for key in [k for k in state if k.endswith("self_attention.linear_qkv.weight")]:
            prefix = key[: -len("linear_qkv.weight")]
            state[key] = fold_layer(prefix, full)
    return state


@pytest.mark.parametrize(
    "fields",
    [
        dict(attention_variant="kha", kha_variant="linear"),
        dict(attention_variant="kha", kha_variant="linear", kha_fold_linear=True),
        dict(attention_variant="kha", kha_variant="mlp"),
        dict(attention_variant="kha", kha_variant="mlp", kha_targets=("q", "k", "v")),
        dict(attention_variant="kha", kha_variant="gate", kha_targets=("q", "k", "v")),
        dict(attention_variant="mea", mea_head_norm=False),
        dict(attention_variant="mea", mea_head_norm=False, mea_tp_exchange="weights"),
    ],
    ids=["kha-linear", "kha-fold-linear", "kha-mlp", "kha-mlp-qkv", "kha-gate-qkv",
         "mea-identity-no-norm", "mea-weights-identity-no-norm"],
)
def test_variant_at_init_computes_exactly_the_plain_model(single_rank, fields):
    variant = build_gpt(tiny_config(**fields))
    plain = build_gpt(tiny_config())
    missing, unexpected = plain.load_state_dict(plain_state(variant), strict=False)
    assert not missing and not unexpected
    assert torch.equal(logits(variant), logits(plain))


@pytest.mark.parametrize("exchange", ["activations", "weights"])
@pytest.mark.parametrize("components", [4, 2], ids=["nc=ng", "virtual-nc=ng/2"])
def test_mea_without_head_norm_equals_plain_model_with_folded_kv_weights(
    single_rank, components, exchange
):
    config = tiny_config("mea", mea_head_norm=False, mea_num_kv_components=components,
                         mea_mix_init="normal", mea_tp_exchange=exchange)
    mea = build_gpt(config)
    perturb_plugin_params(mea)
    np_, ng, hn = config.num_attention_heads, config.num_query_groups, config.kv_channels

    def fold(prefix, state):
        q, k, v = unfuse_qkv(state[prefix + "linear_qkv.weight"], np_, components, hn)
        k = fold_head_mix(k, state[prefix + "head_mix.key_weight"])
        v = fold_head_mix(v, state[prefix + "head_mix.value_weight"])
        return fuse_qkv(q, k, v)

    plain = build_gpt(tiny_config())
    plain.load_state_dict(plain_state(mea, fold), strict=True)
    torch.testing.assert_close(logits(mea), logits(plain), rtol=1e-5, atol=1e-5)
    # Guard against a vacuous pass: the mixing really changes the function.
    unmixed = build_gpt(tiny_config())
    unmixed.load_state_dict(plain_state(build_gpt(tiny_config("mea", mea_head_norm=False))))
    assert not torch.allclose(logits(mea), logits(unmixed), atol=1e-3)


@pytest.mark.parametrize("fold", [False, True], ids=["activations", "kha-fold-linear"])
def test_kha_linear_with_random_matrices_equals_plain_model_with_folded_qkv(single_rank, fold):
    config = tiny_config("kha", kha_variant="linear", kha_fold_linear=fold)
    kha = build_gpt(config)
    perturb_plugin_params(kha)
    np_, ng, hn = config.num_attention_heads, config.num_query_groups, config.kv_channels

    def fold(prefix, state):
        q, k, v = unfuse_qkv(state[prefix + "linear_qkv.weight"], np_, ng, hn)
        q, k, v = (
            fold_kha_linear(w, state[f"{prefix}knock.{name}_weight"])
            for w, name in ((q, "q"), (k, "k"), (v, "v"))
        )
        return fuse_qkv(q, k, v)

    plain = build_gpt(tiny_config())
    plain.load_state_dict(plain_state(kha, fold), strict=True)
    torch.testing.assert_close(logits(kha), logits(plain), rtol=1e-5, atol=1e-5)


def test_parameter_names_follow_the_checkpoint_format(single_rank):
    mea = dict(build_gpt(tiny_config("mea", mea_num_kv_components=2)).named_parameters())
    kha = dict(build_gpt(tiny_config("kha", kha_variant="linear")).named_parameters())
    mlp = dict(build_gpt(tiny_config("kha", kha_variant="mlp")).named_parameters())
    prefix = "decoder.layers.1.self_attention."
    assert mea[prefix + "head_mix.key_weight"].shape == (2, 4)
    assert mea[prefix + "head_mix.value_weight"].shape == (2, 4)
    assert mea[prefix + "head_norm.weight"].shape == (8 * 8,)
    for name in ("q_weight", "k_weight", "v_weight"):
        assert kha[prefix + "knock." + name].shape == (8, 8)
    for name in ("v_up", "v_gate", "v_down"):
        assert mlp[prefix + "knock." + name].shape == (8, 8)
    ablation = dict(build_gpt(tiny_config("kha", kha_variant="mlp", kha_targets=("q", "k")))
                    .named_parameters())
    assert sorted(n.rsplit(".", 1)[1] for n in ablation if n.startswith(prefix + "knock.")) == [
        "k_down", "k_gate", "k_up", "q_down", "q_gate", "q_up"]
    gate = dict(build_gpt(tiny_config("kha", kha_variant="gate")).named_parameters())
    assert [n for n in gate if n.startswith(prefix + "knock.")] == [prefix + "knock.v_gate"]
    # Virtual heads shrink the projection: 8 query heads + 2*2 component K/V heads of 8 channels.
    assert mea[prefix + "linear_qkv.weight"].shape == ((8 + 2 * 2) * 8, 64)


def test_head_norm_runs_inside_linear_proj_and_keeps_the_state_dict_keys(single_rank):
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    from megatron_mea.layers import HeadNormedInput

    model = build_gpt(tiny_config("mea", mea_num_kv_components=2))
    perturb_plugin_params(model)
    attention = model.decoder.layers[0].self_attention
    prefix = "decoder.layers.0.self_attention."
    keys = {k[len(prefix):] for k in model.state_dict() if k.startswith(prefix)}
    assert {"linear_proj.weight", "head_norm.weight"} <= keys
    assert not any(k.startswith("linear_proj.head_norm") for k in keys)  # registered once
    # Megatron's forward calls the registered linear_proj: the head norm, then the projection.
    projection = attention.linear_proj
    assert isinstance(projection, HeadNormedInput) and isinstance(projection, RowParallelLinear)
    assert attention._modules["linear_proj"] is projection
    x = torch.randn(3, 2, 8 * 8)
    out, _ = projection(x)
    expected = torch.nn.functional.linear(attention.head_norm(x), projection.weight)
    torch.testing.assert_close(out, expected)
    assert not torch.allclose(out, torch.nn.functional.linear(x, projection.weight))
    plain = build_gpt(tiny_config("mea", mea_head_norm=False)).decoder.layers[0].self_attention
    assert type(plain.linear_proj) is RowParallelLinear and plain.head_norm is None


def test_core_attention_is_built_once_for_the_composite_groups(single_rank, monkeypatch):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    groups = []
    build = DotProductAttention.__init__

    def recording_init(self, config, *args, **kwargs):
        groups.append(config.num_query_groups)
        build(self, config, *args, **kwargs)

    monkeypatch.setattr(DotProductAttention, "__init__", recording_init)
    model = build_gpt(tiny_config("mea", mea_num_kv_components=2))
    assert groups == [4, 4]  # one per layer, ng = 4 (the projection is sized for nc = 2)
    attention = model.decoder.layers[0].self_attention
    assert attention.core_attention.config.num_query_groups == 4


def test_kha_random_init_draws_every_matrix_from_n_0_1_over_hn(single_rank):
    # The KHA paper's Section 3.3 ablation: no identity start, so the model is not the plain one.
    torch.manual_seed(0)
    model = build_gpt(tiny_config("kha", kha_variant="mlp", kha_targets=("q", "v"),
                                  kha_init="random"))
    knock = {n: p for n, p in model.named_parameters() if ".knock." in n}
    assert len(knock) == 2 * 2 * 3  # 2 layers, 2 targets, up / gate / down
    values = torch.cat([p.detach().flatten() for p in knock.values()])
    assert abs(values.mean().item()) < 0.05
    assert abs(values.std().item() - 8**-0.5) < 0.03  # hn = 8
    plain = build_gpt(tiny_config())
    plain.load_state_dict(plain_state(model), strict=False)
    assert not torch.allclose(logits(model), logits(plain))
