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
- `moe_utils` binds `te_general_gemm = None` when Transformer Engine is absent; 0.16 left the
  name unbound, so every MoE router without TE (on a GPU as on a CPU) raised `NameError`:
  :func:`bind_te_general_gemm_without_te`.
"""

import functools
import inspect

from megatron.core import package_info

__all__ = [
    "COMMON_STATE_FILE",
    "COMMON_STATE_KEY",
    "MEGATRON_CORE_VERSION",
    "batch_on_this_cp_rank",
    "bind_te_general_gemm_without_te",
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


def bind_te_general_gemm_without_te() -> None:
    """Give 0.16's `moe_utils` the `te_general_gemm = None` that later releases bind themselves.

    0.16 imports `te_general_gemm` only inside its `try: import transformer_engine` block, and
    the router's gating (`moe_utils.py:1192,1225`) tests `te_general_gemm is not None`: without
    TE that line raises `NameError` on any device. `None` selects the torch matmul written beside
    it, which is what 0.17+ runs without TE. The binding is permanent and idempotent, and a name
    that is already bound (TE present, or a release that binds it) is never touched. The plugin's
    local-backend spec builders call it for MoE models, before any router is built.
    """
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
