"""megatron_mea.compat: the helpers behave the same on every supported Megatron-Core."""

import pytest
import torch

from tests._dist import run_distributed


def _slice(rank, world_size, tp, cp):
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_mea.compat import batch_on_this_cp_rank

    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, context_parallel_size=cp
    )
    tokens = torch.arange(2 * 16).view(2, 16)
    batch = {"tokens": tokens.clone(), "position_ids": torch.arange(16).repeat(2, 1)}
    out = batch_on_this_cp_rank(batch)
    parallel_state.destroy_model_parallel()
    return out


@pytest.mark.slow
def test_batch_is_whole_at_cp1_in_a_two_rank_world():
    # TP=2, CP=1: both ranks keep the whole sequence (Megatron-Core 0.17+ slices over the WORLD
    # group when no CP group is given).
    for out in run_distributed(_slice, 2, 2, 1):
        assert torch.equal(out["tokens"], torch.arange(32).view(2, 16))
        assert torch.equal(out["position_ids"], torch.arange(16).repeat(2, 1))


@pytest.mark.slow
def test_batch_is_zigzag_sliced_at_cp2():
    outs = run_distributed(_slice, 2, 1, 2)
    assert outs[0]["position_ids"][0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert outs[1]["position_ids"][0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


def test_legacy_grouped_gemm_keyword_only_where_megatron_has_it():
    import inspect

    from megatron.core.models.gpt import gpt_layer_specs

    from megatron_mea.compat import legacy_grouped_gemm_kwargs
    from tests._models import tiny_config

    accepted = "moe_use_legacy_grouped_gemm" in inspect.signature(
        gpt_layer_specs.get_gpt_layer_local_spec
    ).parameters
    assert bool(legacy_grouped_gemm_kwargs(tiny_config())) == accepted


def test_reads_common_state_from_index_exactly_where_dist_ckpt_writes_no_common_pt(
    single_rank, tmp_path
):
    import os

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_mea.compat import COMMON_STATE_FILE, reads_common_state_from_index

    state = {"x": ShardedTensor.from_rank_offsets("x", torch.zeros(2)), "step": 1}
    dist_checkpointing.save(state, str(tmp_path))
    wrote_common_file = os.path.exists(tmp_path / COMMON_STATE_FILE)
    assert reads_common_state_from_index() == (not wrote_common_file)
    assert dist_checkpointing.load_common_state_dict(str(tmp_path))["step"] == 1
