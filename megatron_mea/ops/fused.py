"""Hand-written backward passes for the plugin's memory-bound ops (same math as `functional`).

Autograd through `head_rms_norm` keeps several full-size fp32 intermediates per layer and runs
about a dozen elementwise passes, each into a freshly allocated tensor. On CPU a fresh tensor of
a few MiB costs more than the pass itself (glibc hands the pages back to the OS between steps, so
every allocation page-faults again), so the functions here also count allocations:
`HeadRMSNormFunction` saves only the input and the per-head inverse RMS, allocates one full-size
tensor forward and one backward, and works in place otherwise. `tests/ops/test_fused.py` checks
outputs and gradients against `head_rms_norm` (gradcheck in fp64, fp32 and bf16 tolerances).

Shape legend: `...` leading dims (`[s, b]`, tokens), `np` heads, `hn` head dim.
"""

import torch
from torch.autograd.function import once_differentiable


class HeadRMSNormFunction(torch.autograd.Function):
    """`head_rms_norm(x, weight, eps)` with a fused backward.

    Forward: `y = x * r * w`, `r = rsqrt(mean(x^2) + eps)` per head (over `hn`).
    Backward, with `g = dy * w` and `n = x * r`: `dx = r * (g - n * mean(g * n))`,
    `dw = sum(dy * n)` over every leading dim. Computed in fp32 (or wider), returned in the
    inputs' dtypes.

    Shapes: x `[..., np, hn]`, weight `[np, hn]`; the output is x's shape and dtype.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        # The squares' buffer becomes the output: one full-size allocation, and the same
        # operations in the same order as `head_rms_norm`, so the outputs are identical.
        out = torch.square(wide)
        inv_rms = torch.rsqrt(out.mean(dim=-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, inv_rms)
        torch.mul(wide, inv_rms, out=out)
        return out.mul_(weight.to(wide.dtype)).to(x.dtype)

    @staticmethod
    @once_differentiable  # the in-place backward builds no graph of its own
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, inv_rms = ctx.saved_tensors
        wide = x.to(inv_rms.dtype)
        grad = grad_out.to(inv_rms.dtype)
        weight_wide = weight.to(inv_rms.dtype)
        # One buffer serves every full-size intermediate in turn: dy * n (for dw and the
        # correction), then g, then dx. `grad_out` itself is autograd's and is not written.
        buffer = torch.mul(grad, wide).mul_(inv_rms)  # dy * n
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = buffer.sum(dim=tuple(range(grad.dim() - 2))).to(weight.dtype)
        if not ctx.needs_input_grad[0]:
            return None, grad_weight, None
        # mean(g * n) = mean(dy * n * w), per head: [..., np, 1]
        correction = buffer.mul_(weight_wide).mean(dim=-1, keepdim=True)
        grad_x = torch.mul(grad, weight_wide, out=buffer)  # g
        # g - n * mean(g * n), with n * c = x * (r * c) so that n needs no buffer of its own
        grad_x.addcmul_(wide, correction.mul_(inv_rms), value=-1).mul_(inv_rms)
        return grad_x.to(x.dtype), grad_weight, None


def head_rms_norm_fused(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`functional.head_rms_norm` with the fused backward of `HeadRMSNormFunction`.

    Args:
        x: `[..., np, hn]`.
        weight: `[np, hn]`.
        eps: added to the mean of squares.

    Returns:
        `[..., np, hn]` in `x.dtype`.
    """
    return HeadRMSNormFunction.apply(x, weight, eps)
