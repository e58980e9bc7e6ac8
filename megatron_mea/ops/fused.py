"""Hand-written backward passes for the plugin's memory-bound ops (same math as `functional`).

Autograd through `head_rms_norm` keeps several full-size fp32 intermediates per layer and runs
about a dozen elementwise passes; `HeadRMSNormFunction` saves only the input and the per-head
inverse RMS and needs about half the passes. `tests/ops` checks it against `head_rms_norm` with
gradcheck in fp64.
"""

import torch


class HeadRMSNormFunction(torch.autograd.Function):
    """`head_rms_norm(x, weight, eps)` with a fused backward.

    Forward: `y = x * r * w`, `r = rsqrt(mean(x^2) + eps)` per head (over `hn`).
    Backward, with `g = dy * w` and `n = x * r`: `dx = r * (g - n * mean(g * n))`,
    `dw = sum(dy * n)`
    over every leading dim. Computed in fp32 (or wider), returned in the inputs' dtypes.

    Shapes: x `[..., np, hn]`, weight `[np, hn]`.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        inv_rms = torch.rsqrt(wide.square().mean(dim=-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, inv_rms)
        return (wide * inv_rms).mul_(weight.to(wide.dtype)).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, inv_rms = ctx.saved_tensors
        wide = x.to(inv_rms.dtype)
        grad = grad_out.to(inv_rms.dtype)
        normed = wide * inv_rms  # x * r, reused by both gradients
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad * normed).sum(dim=tuple(range(grad.dim() - 2))).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            g = grad.mul_(weight.to(grad.dtype)) if grad is not grad_out else grad * weight
            # x * r^2 * mean(g * x) = normed * mean(g * normed)
            correction = (g * normed).mean(dim=-1, keepdim=True)
            grad_x = g.sub_(normed.mul_(correction)).mul_(inv_rms).to(x.dtype)
        return grad_x, grad_weight, None


def head_rms_norm_fused(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`functional.head_rms_norm` with the fused backward of `HeadRMSNormFunction`."""
    return HeadRMSNormFunction.apply(x, weight, eps)
