"""Transformer Engine (skipped where it does not import): the TE spec of every variant against
the local spec with the same weights, TEDotProductAttention on the strided, mixed K/V that MEA
hands it, and FP8 forward + backward of one layer (on GPUs with FP8: compute capability 8.9+)."""

import pytest
import torch

from tests.gpu._layers import (
    GROUPS,
    HEADS,
    HIDDEN,
    build_layer,
    inputs,
    load,
    make_config,
    reference_state,
    rel,
    run,
)

TE_VARIANTS = ["baseline", "mea-activations", "mea-virtual", "mea-weights", "kha-linear",
               "kha-linear-folded", "kha-mlp"]


@pytest.fixture
def te():
    return pytest.importorskip("transformer_engine.pytorch")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", TE_VARIANTS)
def test_te_spec_matches_the_local_spec_in_bf16(single_rank, te, variant):
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    state = reference_state(variant)
    config = make_config(variant, torch.bfloat16)
    te_layer = load(build_layer(config, use_te=True), state, use_te=True)
    assert isinstance(te_layer.self_attention.core_attention, TEDotProductAttention)
    local = load(build_layer(config, core_attention="sdpa"), state)
    x, grad = inputs(torch.bfloat16)
    out_te, dx_te, grads_te = run(te_layer, x, grad)
    out_local, dx_local, _ = run(local, x, grad)
    assert torch.isfinite(out_te).all() and torch.isfinite(dx_te).all()
    assert rel(out_te, out_local) < 3e-2
    assert rel(dx_te, dx_local) < 5e-2
    assert all(torch.isfinite(g).all() for g in grads_te.values())
    plugin = [n for n in grads_te if "head_mix" in n or "knock" in n or "head_norm" in n]
    assert all(grads_te[n].abs().sum() > 0 for n in plugin), plugin


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "interleaved"])
def test_te_core_attention_on_mixed_key_value(single_rank, te, layout):
    """K/V as HLC produces them: contiguous `[s, b, ng, hn]` (TP=1), or views of one
    `[s, b, ng, 2, hn]` buffer (the `activations` exchange at TP>1), with GQA."""
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_mea.ops import head_mix

    config = make_config("mea-activations", torch.bfloat16)
    attention = TEDotProductAttention(config=config, layer_number=1,
                                      attn_mask_type=AttnMaskType.causal, attention_type="self")
    hn, s, b, components = HIDDEN // HEADS, 256, 2, 2
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(s, b, HEADS, hn, generator=gen).cuda().bfloat16().requires_grad_()
    comp = torch.randn(s, b, components, 2, hn, generator=gen).cuda().bfloat16().requires_grad_()
    mix = torch.randn(2, components, GROUPS, generator=gen).cuda().bfloat16()

    def key_value():
        if layout == "contiguous":
            return (head_mix(comp[..., 0, :], mix[0]).contiguous(),
                    head_mix(comp[..., 1, :], mix[1]).contiguous())
        kv = torch.stack([head_mix(comp[..., i, :], mix[i]) for i in range(2)], dim=-2)
        return kv[..., 0, :], kv[..., 1, :]

    grad = torch.randn(s, b, HEADS * hn, generator=gen).cuda().bfloat16()
    key, value = key_value()
    out = attention(q, key, value, None, attn_mask_type=AttnMaskType.causal)
    out.backward(grad)
    dq, dcomp = q.grad.clone(), comp.grad.clone()
    q.grad = comp.grad = None
    # Reference: fp32 SDPA on contiguous, repeated K/V.
    key, value = key_value()
    qf, kf, vf = (t.float().permute(1, 2, 0, 3) for t in (q, key, value))
    repeat = HEADS // GROUPS
    ref = torch.nn.functional.scaled_dot_product_attention(
        qf, kf.repeat_interleave(repeat, 1), vf.repeat_interleave(repeat, 1), is_causal=True)
    ref = ref.permute(2, 0, 1, 3).reshape(s, b, -1)
    ref.backward(grad.float())
    assert rel(out, ref) < 2e-2
    assert rel(dq, q.grad) < 3e-2
    assert rel(dcomp, comp.grad) < 3e-2


FP8_VARIANTS = ["baseline", "mea-activations", "mea-weights", "kha-linear-folded", "kha-mlp"]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", FP8_VARIANTS)
def test_fp8_forward_and_backward_of_one_layer(single_rank, te, variant):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+ (Ada, Hopper, Blackwell)")
    from transformer_engine.common.recipe import DelayedScaling, Format

    state = reference_state(variant)
    fp8_layer = load(build_layer(make_config(variant, torch.bfloat16, fp8="hybrid"), use_te=True),
                     state, use_te=True)
    bf16_layer = load(build_layer(make_config(variant, torch.bfloat16), use_te=True), state,
                      use_te=True)
    x, grad = inputs(torch.bfloat16)
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16,
                            amax_compute_algo="max")
    for _ in range(3):  # delayed scaling: the scales settle after the first steps
        with te.fp8_autocast(enabled=True, fp8_recipe=recipe):
            out8, dx8, grads8 = run(fp8_layer, x, grad)
    out16, dx16, _ = run(bf16_layer, x, grad)
    assert torch.isfinite(out8).all() and torch.isfinite(dx8).all()
    assert all(torch.isfinite(g).all() for g in grads8.values())
    # e4m3 keeps 3 bits of mantissa: a few percent per GEMM.
    assert rel(out8, out16) < 0.15
    assert rel(dx8, dx16) < 0.25
