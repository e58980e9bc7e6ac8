"""Decoding from the component cache (`ops/decode.py`) against the plain path: build the composite
keys (HLC, RMS k norm, RoPE) and values, then ordinary causal GQA attention. Forward output and
every gradient, for one and several new tokens, with and without the k norm."""

import pytest
import torch

from megatron_mea.ops.decode import (
    component_attention,
    decode_mask,
    grouped_attention,
    inverse_rms,
)
from megatron_mea.ops.functional import head_mix
from megatron_mea.ops.reference import causal_attention, rms_norm, rope

B, NP, NG, HN, T = 2, 8, 4, 8, 9
EPS = 1e-5
BASE = 10000.0


def _leaves(nc, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).requires_grad_()

    return dict(
        query=rand(B, 3, NP, HN),  # the last 3 positions' queries, q-normed, not RoPE'd
        key=rand(B, T, nc, HN),  # component keys as projected (no norm, no RoPE)
        value=rand(B, T, nc, HN),
        key_mix=rand(nc, NG, scale=0.7),
        value_mix=rand(nc, NG, scale=0.7),
        norm=(1 + rand(HN, scale=0.3)).detach().requires_grad_(),
    )


def _seq_first(x):
    return x.transpose(0, 1)


def _plain(t, query, key, value, key_mix, value_mix, norm):
    """Composite heads first, exactly as the layer's cache-free forward orders the steps."""
    s = query.shape[1]
    keys = head_mix(key, key_mix)
    if norm is not None:
        keys = rms_norm(keys, norm, EPS)
    keys = rope(_seq_first(keys), BASE)
    q = rope(_seq_first(query), BASE, offset=t - s)
    out = causal_attention(q, keys, _seq_first(head_mix(value, value_mix)), HN**-0.5)
    return _seq_first(out)


def _from_components(t, query, key, value, key_mix, value_mix, norm):
    """What the decoder caches: RoPE(w * k_c) and 1/rms of each composite key; mix on the
    query side."""
    s = query.shape[1]
    scales = None
    if norm is not None:
        scales = inverse_rms(head_mix(key, key_mix), EPS).transpose(1, 2)  # [b, ng, T]
        key = key * norm
    keys = _seq_first(rope(_seq_first(key), BASE))
    q = _seq_first(rope(_seq_first(query), BASE, offset=t - s))
    return component_attention(q, keys, value, key_mix, value_mix, HN**-0.5, scales,
                               decode_mask(s, t))


@pytest.mark.parametrize("new_tokens", [1, 3])
@pytest.mark.parametrize("with_norm", [True, False], ids=["k-norm", "no-k-norm"])
@pytest.mark.parametrize("nc", [2, 1, 4], ids=["nc=ng/2", "nc=1", "nc=ng"])
def test_component_attention_equals_composite_attention_forward_and_backward(
    nc, with_norm, new_tokens
):
    leaves = _leaves(nc)
    leaves["query"] = leaves["query"][:, -new_tokens:].detach().requires_grad_()
    if not with_norm:
        leaves["norm"] = None
    inputs = {k: v for k, v in leaves.items() if v is not None}
    upstream = torch.randn(B, new_tokens, NP, HN, dtype=torch.float64)

    got = _from_components(T, **leaves)
    grads = torch.autograd.grad(got, list(inputs.values()), upstream)
    want = _plain(T, **leaves)
    expected = torch.autograd.grad(want, list(inputs.values()), upstream)

    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for name, g, e in zip(inputs, grads, expected):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-9, msg=name)


def test_key_scales_are_not_vacuous():
    # Guard: the 1/rms scalars change the result (the k norm does not cancel in the softmax).
    leaves = _leaves(2)
    with torch.no_grad():
        query = _seq_first(rope(_seq_first(leaves["query"][:, -1:]), BASE, offset=T - 1))
        keys = _seq_first(rope(_seq_first(leaves["key"] * leaves["norm"]), BASE))
        scales = inverse_rms(head_mix(leaves["key"], leaves["key_mix"]), EPS).transpose(1, 2)
        args = (query, keys, leaves["value"], leaves["key_mix"], leaves["value_mix"], HN**-0.5)
        scaled, unscaled = component_attention(*args, scales), component_attention(*args)
    assert (scaled - unscaled).abs().max() > 1e-3


@pytest.mark.parametrize("new_tokens", [1, 4])
def test_grouped_attention_equals_reference_gqa_forward_and_backward(new_tokens):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(B, new_tokens, NP, HN, generator=gen, dtype=torch.float64).requires_grad_()
    k = torch.randn(B, T, NG, HN, generator=gen, dtype=torch.float64).requires_grad_()
    v = torch.randn(B, T, NG, HN, generator=gen, dtype=torch.float64).requires_grad_()
    upstream = torch.randn(B, new_tokens, NP, HN, dtype=torch.float64)
    got = grouped_attention(q, k, v, 0.3, decode_mask(new_tokens, T))
    want = _seq_first(causal_attention(_seq_first(q), _seq_first(k), _seq_first(v), 0.3))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for g, e in zip(torch.autograd.grad(got, (q, k, v), upstream),
                    torch.autograd.grad(want, (q, k, v), upstream)):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-9)


def test_decode_mask_hides_only_later_positions():
    assert decode_mask(1, 5) is None
    mask = decode_mask(3, 5)
    # New tokens sit at positions 2, 3, 4.
    assert mask.tolist() == [
        [False, False, False, True, True],
        [False, False, False, False, True],
        [False, False, False, False, False],
    ]
