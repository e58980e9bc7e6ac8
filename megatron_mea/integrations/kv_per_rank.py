"""KV-cache bytes one serving rank holds per token, baseline GQA against MEA virtual heads, for
the layouts vLLM serves a model with; and the warning when a layout loses MEA's saving.

Pure arithmetic (no torch, no vLLM). Notation: `L` layers, `ng` K/V heads (groups), `nc` MEA
component heads, `hn` head dim, `t` tensor-parallel size of attention.

- Tensor parallelism: the baseline splits its `ng` K/V heads over the ranks, and replicates
  one per rank once `t > ng` (vLLM's rule), so a rank caches `max(1, ng/t)` heads. MEA's plugin
  caches all `nc` components on every rank (each query head needs all of them), so the per-rank
  ratio is `nc / max(1, ng/t)`: the saving is gone at `t >= ng/nc`, and past it MEA holds more
  than the baseline.
- Data-parallel attention (vLLM's `--data-parallel-size N --enable-expert-parallel` with
  `--tensor-parallel-size 1`): each rank runs the whole attention of its own requests, the
  experts are split over all ranks; per rank the caches are the TP=1 ones, ratio `nc/ng`.

With a k norm kept exact by a scaled-components cache (the k norm after the mix), each token
also carries one scale per composite key of the rank's own groups (`max(1, ng/t)`), in the
cache dtype; the k norm before the mix (`mea_key_norm_before_mix`) needs none.
"""

from typing import Optional


def kv_heads_per_rank(num_query_groups: int, tensor_parallel_size: int) -> int:
    """K/V heads a rank of a baseline GQA model caches under TP: `max(1, ng/t)`."""
    return max(1, num_query_groups // tensor_parallel_size)


def kv_bytes_per_token_per_rank(
    num_layers: int,
    num_query_groups: int,
    head_dim: int,
    tensor_parallel_size: int = 1,
    num_kv_components: Optional[int] = None,
    key_scales: bool = False,
    bytes_per_element: int = 2,
) -> int:
    """KV-cache bytes per token that one rank holds, all layers.

    Args:
        num_layers: L.
        num_query_groups: ng.
        head_dim: hn.
        tensor_parallel_size: t of attention (1 under data-parallel attention).
        num_kv_components: MEA's nc, every rank caching all of them; None for the baseline.
        key_scales: MEA with a scaled-components cache: one scale per composite key of the
            rank's groups.
        bytes_per_element: 2 for bf16. Default: 2.
    """
    local_groups = kv_heads_per_rank(num_query_groups, tensor_parallel_size)
    if num_kv_components is None:
        elements = 2 * local_groups * head_dim
    else:
        elements = 2 * num_kv_components * head_dim + (local_groups if key_scales else 0)
    return num_layers * elements * bytes_per_element


def tp_loses_kv_saving_message(config, tensor_parallel_size: int) -> Optional[str]:
    """One line when MEA's virtual heads save no KV cache per rank at this TP size
    (`nc < ng` and `t >= ng/nc`), else None.

    Args:
        config: a native export's config (`megatron_mea.integrations.transformers`):
            `attention_variant`,
            `num_key_value_heads`, `mea_num_kv_components`.
        tensor_parallel_size: t.
    """
    if getattr(config, "attention_variant", None) != "mea":
        return None
    ng, nc, t = config.num_key_value_heads, config.mea_num_kv_components, tensor_parallel_size
    if nc >= ng or t * nc < ng:
        return None
    return (
        f"MEA: tensor_parallel_size {t} >= num_key_value_heads / mea_num_kv_components "
        f"({ng}/{nc}): every rank caches all {nc} components against the baseline's "
        f"{kv_heads_per_rank(ng, t)} K/V head(s) per rank, so the KV-cache saving is gone; "
        f"serve with TP < {ng // nc}, or with data-parallel attention (--data-parallel-size "
        "with --enable-expert-parallel for MoE, TP 1)"
    )
