"""One transformer layer of each variant on the GPU, built from the same weights in several
precisions and specs, and run forward + backward (shared by the GPU tier)."""

import torch

from megatron_mea import MEATransformerConfig, get_gpt_layer_spec
from tests._models import perturb_plugin_params

# hidden 256, 8 query heads / 4 groups, head dim 32: FP8 GEMMs need multiples of 16 everywhere.
HIDDEN, HEADS, GROUPS, FFN, SEQ, BATCH = 256, 8, 4, 512, 128, 2

VARIANTS = {
    "baseline": dict(attention_variant="standard"),
    "mea-activations": dict(attention_variant="mea", mea_mix_init="normal"),
    "mea-virtual": dict(attention_variant="mea", mea_num_kv_components=2, mea_mix_init="normal"),
    "mea-weights": dict(attention_variant="mea", mea_mix_init="normal",
                        mea_tp_exchange="weights"),
    "kha-linear": dict(attention_variant="kha", kha_variant="linear"),
    "kha-linear-folded": dict(attention_variant="kha", kha_variant="linear",
                              kha_fold_linear=True),
    "kha-mlp": dict(attention_variant="kha", kha_variant="mlp"),
}


def make_config(variant, dtype=torch.float32, **extra):
    """A one-layer config of `variant`; weights initialised on the CPU (seeded, any dtype)."""
    fields = dict(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
        ffn_hidden_size=FFN, normalization="RMSNorm", qk_layernorm=True, add_bias_linear=False,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, pipeline_dtype=dtype,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
    )
    fields.update(VARIANTS[variant])
    fields.update(extra)
    return MEATransformerConfig(**fields)


def build_layer(config, use_te=False, core_attention="megatron", device="cuda"):
    from megatron.core.transformer.spec_utils import build_module

    torch.manual_seed(1234)
    kwargs = {} if use_te else {"core_attention": core_attention}
    spec = get_gpt_layer_spec(config, use_transformer_engine=use_te, **kwargs)
    return build_module(spec, config=config, layer_number=1).to(device)


def reference_state(variant):
    """fp32 weights of `variant`'s layer with its plugin parameters moved off identity."""
    layer = build_layer(make_config(variant), device="cpu")
    perturb_plugin_params(layer)
    return {k: v for k, v in layer.state_dict().items() if not k.endswith("_extra_state")}


# Local-spec parameter names -> the TE spec's (TE fuses the input norms into the next linear).
LOCAL_TO_TE = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def load(layer, state, use_te=False):
    """Load local-spec `state` into `layer` (casting); every parameter must be covered."""
    if use_te:
        state = {LOCAL_TO_TE.get(k, k): v for k, v in state.items()}
    missing, unexpected = layer.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    assert not missing and not unexpected, (missing, unexpected)
    return layer


def inputs(dtype, seed=7):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
    grad = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
    return x.to("cuda", dtype), grad.to("cuda", dtype)


def run(layer, x, grad):
    """Output, input gradient and parameter gradients (fp32 copies) of one forward+backward."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    x = x.detach().clone().requires_grad_()
    rotary = RotaryEmbedding(kv_channels=HIDDEN // HEADS, rotary_percent=1.0)(SEQ).to(x.device)
    layer.zero_grad(set_to_none=True)
    out, _ = layer(x, attention_mask=None, rotary_pos_emb=rotary)
    out.backward(grad)
    grads = {n: p.grad.float() for n, p in layer.named_parameters() if p.grad is not None}
    return out.detach().float(), x.grad.float(), grads


def rel(a, b) -> float:
    """||a - b|| / ||b|| in fp32."""
    a, b = a.float(), b.float().to(a.device)
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()
