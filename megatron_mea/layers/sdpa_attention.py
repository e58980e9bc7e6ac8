"""A core attention for Megatron's local (non-Transformer-Engine) spec on torch's fused kernel.

Megatron's local `DotProductAttention` materialises the `[b, np, sq, sk]` score and probability
tensors (and, with GQA, K/V repeated to `np` heads) and runs an unfused softmax: at sequence 2048
on a CPU it is most of a layer's step. `SDPADotProductAttention` computes the same function with
`torch.nn.functional.scaled_dot_product_attention` (flash kernels on CPU and GPU where the inputs
allow), keeping Megatron's interface, layouts and settings:

- inputs query `[sq, b, np, hn]`, key/value `[sk, b, ng, hn]`; output `[sq, b, np*hn]`;
- GQA without repeating K/V (`enable_gqa=True`, torch >= 2.5; older torch repeats them);
- the mask as Megatron's `FusedScaleMaskSoftmax` resolves it: a sliding window where the layer
  has one, else the given mask (True = masked), else causal when `attn_mask_type` is causal and
  `sq > 1` (a one-token decode step attends to the whole cache);
- `softmax_scale` and `apply_query_key_layer_scaling` (net scale `softmax_scale * coeff`, as
  Megatron's softmax multiplies back the coefficient it divided out);
- attention dropout drawn inside Megatron's RNG tracker fork when sequence parallelism is off.

Differences: the softmax runs inside the kernel (fp32 accumulation in bf16/fp16), not on bf16
scores, so low-precision outputs round differently (fp32 outputs and gradients agree with
Megatron's to rounding; `tests/layers/test_sdpa_attention.py`). A query row whose every key is
masked gives the mean of V in Megatron (it fills masked scores with -10000) and 0 here with
torch 2.5+'s kernels (checked on the CPU); such rows only occur for padding queries. Dropout masks differ (another kernel draws them). Refused, like
in Megatron's local attention: packed sequences, attention bias, context parallelism; and softmax
types other than `vanilla` (no sink/offset term in torch's kernel).

Select it with `get_gpt_layer_spec(..., core_attention="sdpa")` (`megatron_mea/specs.py`).
"""

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

# `enable_gqa` (K/V with fewer heads than Q, no repeat materialised) arrived in torch 2.5.
_TORCH_VERSION = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
SDPA_HAS_GQA = _TORCH_VERSION >= (2, 5)


def sliding_window_keep(sq: int, sk: int, window_size, device) -> torch.Tensor:
    """`[sq, sk]` bool, True where a query may attend: the complement of Megatron's
    `get_sliding_window_causal_mask` (same diagonals), built on `device`."""
    ones = torch.ones(sq, sk, dtype=torch.bool, device=device)
    upper = torch.triu(ones, diagonal=sk - sq - window_size[0])
    return torch.tril(upper, diagonal=sk - sq + window_size[1])


class SDPADotProductAttention(DotProductAttention):
    """Megatron's `DotProductAttention`, computed by `F.scaled_dot_product_attention`.

    Same constructor (hence the same spec slot, parameters and sharded state dict) and forward
    signature. See the module docstring for what is and is not supported.
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type, *args, **kwargs):
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(
                f"core_attention='sdpa' supports softmax_type='vanilla' only, not "
                f"{config.softmax_type!r} (torch's kernel has no softmax offset); use Megatron's "
                "core attention"
            )
        super().__init__(config, layer_number, attn_mask_type, attention_type, *args, **kwargs)
        softmax = self.scale_mask_softmax
        # Megatron scales the scores by softmax_scale (already divided by the layer-scaling
        # coefficient) and its softmax multiplies the coefficient back.
        self.sdpa_scale = self.softmax_scale * (softmax.scale if softmax.scale is not None else 1.0)
        self.window_size = softmax.window_size

    def _mask(self, attention_mask: Optional[torch.Tensor], sq: int, sk: int, device):
        """(attn_mask for torch with True = attend, or None; is_causal), as Megatron resolves it."""
        if self.window_size is not None:
            return sliding_window_keep(sq, sk, self.window_size, device), False
        if attention_mask is not None:
            return ~attention_mask.to(torch.bool), False
        if self.attn_mask_type == AttnMaskType.causal and sq > 1:
            if sq != sk:
                raise ValueError(
                    f"causal attention with sq={sq} != sk={sk} needs an explicit attention_mask "
                    "(as Megatron's DotProductAttention)"
                )
            return None, True
        return None, False

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """query `[sq, b, np, hn]`, key/value `[sk, b, ng, hn]` -> context `[sq, b, np*hn]`.

        `attn_mask_type` is ignored, as Megatron's local attention ignores it (the layer's own
        type decides)."""
        if packed_seq_params is not None:
            raise ValueError("packed sequences need TEDotProductAttention (as Megatron's local)")
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported (as Megatron's local attention)")
        sq, b, num_heads = query.shape[:3]
        sk, num_groups = key.shape[0], key.shape[2]
        mask, causal = self._mask(attention_mask, sq, sk, query.device)
        # [s, b, heads, hn] -> [b, heads, s, hn]: views; the kernels take strided inputs.
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        extra = {}
        if num_heads != num_groups:
            if SDPA_HAS_GQA:
                extra["enable_gqa"] = True
            else:
                repeat = num_heads // num_groups
                k = k.repeat_interleave(repeat, dim=1)
                v = v.repeat_interleave(repeat, dim=1)
        dropout = self.attention_dropout.p if self.training else 0.0

        def attend():
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                scale=self.sdpa_scale, **extra,
            )

        if dropout > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = attend()
        else:
            context = attend()
        # [b, np, sq, hv] -> [sq, b, np*hv] (a copy unless the kernel's layout already is it).
        return context.permute(2, 0, 1, 3).reshape(sq, b, -1)
