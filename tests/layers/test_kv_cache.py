"""MEA's static KV cache (`layers/kv_cache.py`): which k norms factor out of the mix, and the buffer
layout Megatron's static context relies on (a pair, batch at dim 1, keys `[T, B, heads, hn]`)."""

import torch
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.transformer.torch_norm import L2Norm

from megatron_mea.layers import kv_cache
from megatron_mea.layers.kv_cache import CacheKind, MEAKVCache, rms_factors


class RMSNorm(torch.nn.Module):
    """Stands in for Transformer Engine's RMSNorm (not installable without CUDA; same
    attributes), which stores the scale minus one with `zero_centered_gamma`."""

    def __init__(self, hidden, eps, zero_centered_gamma):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(hidden))
        self.eps, self.zero_centered_gamma = eps, zero_centered_gamma

    def forward(self, x):
        scale = self.weight + 1 if self.zero_centered_gamma else self.weight
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * scale


def test_rms_type_norms_factor_into_a_scale_and_an_inverse_rms(monkeypatch):
    # Transformer Engine's class is looked up in one place; the stand-in takes its part.
    monkeypatch.setattr(kv_cache, "transformer_engine_class", lambda name: RMSNorm)
    x = torch.randn(5, 3, 8, dtype=torch.float64)
    norms = [
        torch.nn.RMSNorm(8, eps=1e-5, dtype=torch.float64),
        L2Norm(8, eps=1e-6),
        RMSNorm(8, 1e-5, zero_centered_gamma=True).double(),
        RMSNorm(8, 1e-5, zero_centered_gamma=False).double(),
    ]
    with torch.no_grad():
        norms[0].weight.normal_()
        for norm in norms:
            factors = rms_factors(norm)
            inverse_rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + factors.eps_for(x.dtype))
            expected = x * inverse_rms * (1 if factors.scale is None else factors.scale)
            torch.testing.assert_close(norm(x), expected)
    assert rms_factors(torch.nn.LayerNorm(8)) is None  # mean and bias: no factoring
    assert rms_factors(torch.nn.RMSNorm(8)).eps_for(torch.float64) == torch.finfo(torch.float64).eps


def test_rms_norms_are_told_apart_by_class_not_name():
    # A module that merely looks like Transformer Engine's RMSNorm is not taken for it.
    assert rms_factors(RMSNorm(8, 1e-5, zero_centered_gamma=False)) is None


def test_cache_keeps_megatrons_pair_layout_and_follows_swap_key_value_dict():
    context = StaticInferenceContext(max_batch_size=3, max_sequence_length=6)
    like = torch.empty(0)
    cache = MEAKVCache.of(context, 1, CacheKind.SCALED_COMPONENTS, 2, 4, num_scales=5, like=like)
    plain = MEAKVCache.of(context, 2, CacheKind.COMPOSITES, 2, 4, num_scales=0, like=like)
    keys, values = torch.randn(6, 3, 2, 4), torch.randn(6, 3, 2, 4)
    scales = torch.randn(6, 3, 5)
    cache.write(0, slice(0, 3), keys[:4], values[:4], scales[:4])
    cache.write(4, slice(0, 3), keys[4:], values[4:], scales[4:])
    plain.write(0, slice(0, 3), keys, values)
    assert context.key_value_memory_dict[1][0].shape == (6, 3, 2, 4)  # heads readable
    assert context.key_value_memory_dict[1][1].shape == (6, 3, 2 * 4 + 5)
    assert context.key_value_memory_dict[2][1].shape == (6, 3, 2, 4)

    order = [2, 0, 1]
    context.swap_key_value_dict(order)  # Megatron's beam reordering of every layer's pair
    for layer, with_scales in ((1, True), (2, False)):
        kind = CacheKind.SCALED_COMPONENTS if with_scales else CacheKind.COMPOSITES
        entry = MEAKVCache(kind, *context.key_value_memory_dict[layer])
        got_keys, got_values, got_scales = entry.read(5, slice(1, 3))  # rows 1, 2 after swap
        assert torch.equal(got_keys, keys[:5, order[1:]].transpose(0, 1))
        assert torch.equal(got_values, values[:5, order[1:]].transpose(0, 1))
        if with_scales:
            assert torch.equal(got_scales, scales[:5, order[1:]].transpose(0, 1))
        else:
            assert got_scales is None
