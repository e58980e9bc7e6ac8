"""Which of Megatron-Core's fused kernels a run asks for: decided by what is installed, in one place.

Megatron's config flags name kernels that live in optional packages, and a flag set without its
package fails at model build or at the first bf16 forward, on a GPU as on a CPU:

- `persist_layer_norm`: Apex's persistent LayerNorm. Without Apex the local spec builds
  `WrappedTorchNorm`, which asserts `persist_layer_norm not supported by torch LayerNorm`
  (`transformer/torch_norm.py:30`); an RMSNorm model gets `WrappedTorchNorm` even with Apex.
- `masked_softmax_fusion`: the `scaled_*masked_softmax_cuda` extensions (built by Apex) used by
  Megatron's local `DotProductAttention` for fp16/bf16 scores; without them the first such
  forward raises `ModuleNotFoundError` (`fusions/fused_softmax.py`).
- `bias_dropout_fusion`: a `torch.compile`d bias + dropout + add. The models built here have no
  linear bias and no hidden dropout, so the fused function has nothing to fuse, and compiling it
  needs a C compiler and Python headers at run time: always off.
- `gradient_accumulation_fusion` (Apex or TE wgrad kernels) and `apply_rope_fusion` (TE or
  Apex): off; the plugin's projections do not use them.

`use_cpu_initialization` is the only flag that follows the device itself.
"""

from megatron_mea import _optional

__all__ = ["fusion_settings"]


def fusion_settings(
    on_gpu: bool,
    normalization: str,
    have_persist_layer_norm: bool = _optional.HAVE_APEX_PERSIST_LAYER_NORM,
    have_fused_softmax: bool = _optional.HAVE_FUSED_SOFTMAX,
) -> dict:
    """The fusion fields of a `TransformerConfig` that this machine can honour.

    Args:
        on_gpu: whether the model runs on CUDA (every fused kernel here is CUDA-only).
        normalization: `"LayerNorm"` or `"RMSNorm"` (Apex's persistent kernel is LayerNorm only).
        have_persist_layer_norm: Apex's persistent LayerNorm imports. Default: probed.
        have_fused_softmax: the fused softmax extensions import. Default: probed.

    Returns:
        `bias_dropout_fusion`, `masked_softmax_fusion`, `persist_layer_norm`,
        `gradient_accumulation_fusion`, `apply_rope_fusion` and `use_cpu_initialization`.
    """
    return dict(
        use_cpu_initialization=not on_gpu,
        bias_dropout_fusion=False,
        masked_softmax_fusion=on_gpu and have_fused_softmax,
        persist_layer_norm=on_gpu and have_persist_layer_norm and normalization == "LayerNorm",
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
    )
