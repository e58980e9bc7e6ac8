"""The Megatron layers against the plain fp32 reference: forward output and every gradient."""

import pytest
import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.spec_utils import build_module

from megatron_mea import get_gpt_layer_spec
from megatron_mea.ops.qkv_layout import unfuse_qkv
from megatron_mea.ops.reference import AttentionParams, attention_ref
from tests._models import CPU_EXACT, perturb_plugin_params
from megatron_mea import MEATransformerConfig

ROPE_BASE = 10000.0

# (id, heads, groups, head_dim, variant fields): MHA, GQA, MQA, odd sizes, virtual heads.
CASES = [
    ("mea-mha", 4, 4, 8, dict(attention_variant="mea")),
    ("mea-gqa-odd", 6, 3, 6, dict(attention_variant="mea", mea_mix_init="normal")),
    ("mea-mqa", 4, 1, 8, dict(attention_variant="mea")),
    ("mea-virtual", 6, 3, 6, dict(attention_variant="mea", mea_num_kv_components=1)),
    ("mea-virtual-2of4", 8, 4, 4, dict(attention_variant="mea", mea_num_kv_components=2)),
    ("mea-no-norm", 4, 2, 8, dict(attention_variant="mea", mea_head_norm=False)),
    ("mea-no-qk-norm", 6, 3, 6, dict(attention_variant="mea", qk_layernorm=False)),
    # The k norm on the components, then HLC (norm-then-mix).
    ("mea-norm-before-mix-2of4", 8, 4, 4, dict(attention_variant="mea", mea_num_kv_components=2,
                                               mea_mix_init="normal",
                                               mea_key_norm_before_mix=True)),
    ("mea-norm-before-mix-mha", 4, 4, 8, dict(attention_variant="mea",
                                              mea_key_norm_before_mix=True)),
    # The `weights` exchange: HLC folded into linear_qkv.
    ("mea-weights-gqa-odd", 6, 3, 6, dict(attention_variant="mea", mea_mix_init="normal",
                                          mea_tp_exchange="weights")),
    ("mea-weights-virtual", 6, 3, 6, dict(attention_variant="mea", mea_num_kv_components=1,
                                          mea_tp_exchange="weights")),
    ("mea-weights-virtual-2of4", 8, 4, 4, dict(attention_variant="mea", mea_num_kv_components=2,
                                               mea_mix_init="normal", mea_tp_exchange="weights")),
    ("mea-auto-mqa", 4, 1, 8, dict(attention_variant="mea", mea_tp_exchange="auto")),
    ("kha-linear-qkv", 4, 2, 8, dict(attention_variant="kha", kha_variant="linear")),
    ("kha-linear-k", 6, 3, 6, dict(attention_variant="kha", kha_variant="linear", kha_targets=("k",))),
    # KHA-Linear folded into linear_qkv.
    ("kha-fold-linear-qkv", 4, 2, 8, dict(attention_variant="kha", kha_variant="linear",
                                          kha_fold_linear=True)),
    ("kha-fold-linear-k", 6, 3, 6, dict(attention_variant="kha", kha_variant="linear",
                                        kha_targets=("k",), kha_fold_linear=True)),
    ("kha-mlp", 4, 1, 8, dict(attention_variant="kha", kha_variant="mlp")),
    ("kha-mlp-mha-no-qk-norm", 4, 4, 6, dict(attention_variant="kha", kha_variant="mlp", qk_layernorm=False)),
    # The KHA paper's Table 2 ablations: the MLP on q, on k, on q, k and v; the gate alone; and
    # its Section 3.3 random initialisation.
    ("kha-mlp-q", 4, 2, 8, dict(attention_variant="kha", kha_variant="mlp", kha_targets=("q",))),
    ("kha-mlp-k", 6, 3, 6, dict(attention_variant="kha", kha_variant="mlp", kha_targets=("k",))),
    ("kha-mlp-qkv", 4, 2, 8, dict(attention_variant="kha", kha_variant="mlp",
                                  kha_targets=("q", "k", "v"))),
    ("kha-gate", 4, 2, 8, dict(attention_variant="kha", kha_variant="gate")),
    ("kha-gate-qk", 6, 3, 6, dict(attention_variant="kha", kha_variant="gate",
                                  kha_targets=("q", "k"))),
    ("kha-random-linear", 4, 2, 8, dict(attention_variant="kha", kha_variant="linear",
                                        kha_init="random")),
    ("kha-random-mlp", 4, 2, 8, dict(attention_variant="kha", kha_variant="mlp",
                                     kha_init="random")),
    ("kha-random-fold-linear", 4, 2, 8, dict(attention_variant="kha", kha_variant="linear",
                                             kha_init="random", kha_fold_linear=True)),
]


def _layer(num_heads, num_groups, head_dim, fields):
    fields = dict(qk_layernorm=True) | fields
    config = MEATransformerConfig(
        num_layers=1,
        hidden_size=num_heads * head_dim + 2,  # hidden != np*hn on purpose
        kv_channels=head_dim,
        num_attention_heads=num_heads,
        num_query_groups=num_groups,
        normalization="RMSNorm",
        add_bias_linear=False,
        layernorm_epsilon=1e-5,
        **CPU_EXACT,
        **fields,
    )
    spec = get_gpt_layer_spec(config, use_transformer_engine=False)
    attention = build_module(spec.submodules.self_attention, config=config, layer_number=1)
    return config, attention


def _reference_leaves(attention, config):
    """Detached copies of the layer's parameters, by parameter name."""
    return {
        name: param.detach().clone().requires_grad_()
        for name, param in attention.named_parameters()
    }


def _reference_forward(x, leaves, config):
    np_, hn, h = config.num_attention_heads, config.kv_channels, config.hidden_size
    nc = getattr(config, "mea_num_kv_components", None) or config.num_query_groups
    q, k, v = unfuse_qkv(leaves["linear_qkv.weight"], np_, nc, hn)
    params = AttentionParams(
        w_q=q.reshape(-1, h),
        w_k=k.reshape(-1, h),
        w_v=v.reshape(-1, h),
        w_o=leaves["linear_proj.weight"],
        q_norm=leaves.get("q_layernorm.weight"),
        k_norm=leaves.get("k_layernorm.weight"),
        mix_k=leaves.get("head_mix.key_weight"),
        mix_v=leaves.get("head_mix.value_weight"),
        head_norm=leaves.get("head_norm.weight"),
        key_norm_before_mix=getattr(config, "mea_key_norm_before_mix", False),
        kha={n.split(".", 1)[1]: t for n, t in leaves.items() if n.startswith("knock.")},
    )
    return attention_ref(
        x, params, num_heads=np_, head_dim=hn, rope_base=ROPE_BASE, eps=config.layernorm_epsilon
    )


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_layer_matches_reference_forward_and_every_gradient(single_rank, case):
    _, num_heads, num_groups, head_dim, fields = case
    config, attention = _layer(num_heads, num_groups, head_dim, fields)
    perturb_plugin_params(attention)
    seq, batch = 7, 3
    x = torch.randn(seq, batch, config.hidden_size, requires_grad=True)
    rotary = RotaryEmbedding(kv_channels=head_dim, rotary_percent=1.0, rotary_base=ROPE_BASE)
    out, _ = attention(x, attention_mask=None, rotary_pos_emb=rotary(seq))
    upstream = torch.randn_like(out)
    out.backward(upstream)

    leaves = _reference_leaves(attention, config)
    x_ref = x.detach().clone().requires_grad_()
    out_ref = _reference_forward(x_ref, leaves, config)
    out_ref.backward(upstream)

    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    params = dict(attention.named_parameters())
    assert set(params) == set(leaves)
    for name, param in params.items():
        assert param.grad is not None, name
        expected = leaves[name].grad
        # fp32 rounding scales with the gradient (the folded path sums in another order).
        atol = 1e-5 * max(1.0, expected.abs().max().item())
        torch.testing.assert_close(param.grad, expected, rtol=1e-5, atol=atol, msg=name)
