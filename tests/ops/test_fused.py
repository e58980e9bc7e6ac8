"""The fused-backward head norm against the autograd reference (`functional.head_rms_norm`)."""

import pytest
import torch

from megatron_mea.ops import head_rms_norm
from megatron_mea.ops.fused import head_rms_norm_fused


def test_fused_head_norm_passes_gradcheck_and_equals_the_reference_in_fp64():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 4, 5, dtype=torch.float64, generator=gen).requires_grad_()
    w = torch.randn(4, 5, dtype=torch.float64, generator=gen).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: head_rms_norm_fused(a, b, 1e-6), (x, w))
    up = torch.randn(3, 2, 4, 5, dtype=torch.float64, generator=gen)
    got = torch.autograd.grad(head_rms_norm_fused(x, w, 1e-6), (x, w), up)
    ref = torch.autograd.grad(head_rms_norm(x, w, 1e-6), (x, w), up)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_head_norm_matches_the_reference_in_training_dtypes(dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, 2, 4, 8, generator=gen).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(4, 8, generator=gen)).to(dtype).requires_grad_()
    up = torch.randn(16, 2, 4, 8, generator=gen).to(dtype)
    out, ref_out = head_rms_norm_fused(x, w, 1e-5), head_rms_norm(x, w, 1e-5)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)  # same forward ops
    got = torch.autograd.grad(out, (x, w), up)
    ref = torch.autograd.grad(ref_out, (x, w), up)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for a, b in zip(got, ref):
        assert a.dtype == dtype
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("needs", [(True, False), (False, True)], ids=["x-only", "weight-only"])
def test_fused_head_norm_gradient_of_one_input_alone_equals_the_reference(needs):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, 3, 2, 7, dtype=torch.float64, generator=gen).requires_grad_(needs[0])
    w = torch.randn(2, 7, dtype=torch.float64, generator=gen).requires_grad_(needs[1])
    wanted = x if needs[0] else w
    up = torch.randn(6, 3, 2, 7, dtype=torch.float64, generator=gen)
    (got,) = torch.autograd.grad(head_rms_norm_fused(x, w, 1e-6), wanted, up)
    (ref,) = torch.autograd.grad(head_rms_norm(x, w, 1e-6), wanted, up)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


def test_fused_head_norm_takes_a_broadcast_gradient_and_leaves_it_unchanged():
    # `.sum()` hands back an expanded (stride-0) gradient: nothing may be written into it.
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 1, 3, 8, dtype=torch.float64, generator=gen).requires_grad_()
    w = torch.randn(3, 8, dtype=torch.float64, generator=gen).requires_grad_()
    got = torch.autograd.grad(head_rms_norm_fused(x, w, 1e-6).sum(), (x, w))
    ref = torch.autograd.grad(head_rms_norm(x, w, 1e-6).sum(), (x, w))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    up = torch.randn(4, 1, 3, 8, dtype=torch.float64, generator=gen)
    kept = up.clone()
    torch.autograd.grad(head_rms_norm_fused(x, w, 1e-6), (x, w), up)
    assert torch.equal(up, kept)
