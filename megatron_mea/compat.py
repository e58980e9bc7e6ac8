"""Differences between the supported Megatron-Core releases (0.16.1 and 0.19.x), in one place.

Every function here checks for a feature (a keyword a function accepts, an attribute an object
has), not for a version number, so a release in between behaves like whichever side it matches.
The rest of the package calls these helpers and never branches on Megatron's version itself.
`MEGATRON_CORE_VERSION` is for messages and for picking vendored Megatron-LM data by tag.

What changed after 0.16.1, and the helper that absorbs it:
- `get_gpt_layer_*_spec` and `TransformerConfig` dropped `moe_use_legacy_grouped_gemm`
  (0.17): :func:`legacy_grouped_gemm_kwargs`.
- `get_batch_on_this_cp_rank` gained a required `is_hybrid_cp` argument, and without a
  `cp_group` it now slices over the whole world instead of the CP group:
  :func:`batch_on_this_cp_rank`.
- `StaticInferenceContext.materialize_only_last_token_logits` moved to `context.config`:
  :func:`materialize_only_last_token_logits`.
- dist-ckpt stopped writing `common.pt`; the common state is a `ShardedObject` named
  `common_state` inside the checkpoint: :data:`COMMON_STATE_FILE`, :data:`COMMON_STATE_KEY`,
  and :func:`reads_common_state_from_index` (0.16.1 cannot read such a checkpoint).
"""

import functools
import inspect

from megatron.core import package_info

__all__ = [
    "COMMON_STATE_FILE",
    "COMMON_STATE_KEY",
    "MEGATRON_CORE_VERSION",
    "batch_on_this_cp_rank",
    "legacy_grouped_gemm_kwargs",
    "materialize_only_last_token_logits",
    "reads_common_state_from_index",
]

MEGATRON_CORE_VERSION: str = package_info.__version__

# The two layouts of a torch_dist checkpoint's non-tensor state: a file beside the shards
# (0.16) or an object stored with them under this key (0.17 and later).
COMMON_STATE_FILE = "common.pt"
COMMON_STATE_KEY = "common_state"


@functools.lru_cache(maxsize=None)
def _accepts(function, keyword: str) -> bool:
    return keyword in inspect.signature(function).parameters


def reads_common_state_from_index() -> bool:
    """Whether dist-ckpt reads a checkpoint whose common state is in the index (no `common.pt`).

    Releases that keep it in `common.pt` load it through a separate common strategy, a
    `common_strategy` argument of `dist_checkpointing.load` that went away with the file.
    """
    from megatron.core import dist_checkpointing

    return not _accepts(dist_checkpointing.load, "common_strategy")


def legacy_grouped_gemm_kwargs(config) -> dict:
    """`{"moe_use_legacy_grouped_gemm": ...}` for the layer-spec builders that still take it.

    Args:
        config: the model's TransformerConfig.

    Returns:
        The keyword to pass to `get_gpt_layer_local_spec` / `..._with_transformer_engine_spec`,
        or `{}` where Megatron-Core no longer has the legacy grouped GEMM.
    """
    from megatron.core.models.gpt import gpt_layer_specs

    if not _accepts(gpt_layer_specs.get_gpt_layer_local_spec, "moe_use_legacy_grouped_gemm"):
        return {}
    return {"moe_use_legacy_grouped_gemm": config.moe_use_legacy_grouped_gemm}


def batch_on_this_cp_rank(batch: dict) -> dict:
    """Megatron's `get_batch_on_this_cp_rank` for plain (not hybrid) context parallelism.

    Args:
        batch: `tokens`, `labels`, `loss_mask`, `position_ids`, `attention_mask` tensors.

    Returns:
        The batch sliced to this CP rank's chunks (unchanged at CP=1).
    """
    from megatron.core import parallel_state, utils

    # The CP group goes in explicitly: from 0.17 a missing `cp_group` means the default (WORLD)
    # group, which would split every sequence over the TP / DP / EP ranks at CP=1.
    cp_group = parallel_state.get_context_parallel_group()
    if _accepts(utils.get_batch_on_this_cp_rank, "is_hybrid_cp"):
        return utils.get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=cp_group)
    return utils.get_batch_on_this_cp_rank(batch, cp_group=cp_group)


def materialize_only_last_token_logits(context) -> bool:
    """Whether a static inference context asks the model for the last position's logits only."""
    config = getattr(context, "config", None)
    if config is not None and hasattr(config, "materialize_only_last_token_logits"):
        return config.materialize_only_last_token_logits
    return context.materialize_only_last_token_logits
