"""`mea-pretrain` with the KHA recipe's router (examples/megatron_lm/kha_moe_6b_a1b.sh: sigmoid
scores, aux-loss-free balancing by an expert bias, fp32 router) at a small scale: it trains, the
bias moves, an interrupted run resumes to the same losses and bias bit for bit, and the
checkpoint exports to Hugging Face with Megatron's logits."""

import pytest
import torch

from tests._dist import run_distributed
from tests._models import tiny_flags
from tests.training.test_pretrain import _train

ROUTER = [
    *tiny_flags(moe_router_topk=2, moe_ffn_hidden_size=32, moe_layer_freq="[1,0]",
                micro_batch_size=2, global_batch_size=4, lr=3e-3, min_lr=3e-4, eval_iters=0,
                mock_data=True, vocab_size=300, train_iters=8),
    "--attention-variant", "kha", "--kha-variant", "mlp", "--moe-router-score-function", "sigmoid",
    "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "1e-2",
    "--moe-router-dtype", "fp32", "--moe-router-load-balancing-type", "none",
    "--moe-router-topk-scaling-factor", "2.0", "--moe-shared-expert-intermediate-size", "48",
]
BIAS = "decoder.layers.0.mlp.router.expert_bias"


def _saved_bias(root):
    from megatron_mea.checkpoint.torch_dist.layerwise import read_checkpoint

    _, groups = read_checkpoint(root)
    return dict(groups)[0][BIAS]


def test_kha_recipe_router_trains_resumes_exactly_and_exports(tmp_path, single_rank):
    full = str(tmp_path / "full")
    losses = run_distributed(_train, 1, [*ROUTER, "--save", full])[0]
    interrupted = str(tmp_path / "interrupted")
    first = run_distributed(_train, 1, [*ROUTER, "--save", interrupted, "--exit-interval", "4"])[0]
    second = run_distributed(_train, 1, [*ROUTER, "--save", interrupted, "--load", interrupted])[0]
    assert first + second == losses  # bitwise
    bias = _saved_bias(full)
    assert bias.dtype == torch.float32 and bias.abs().max() > 0  # the bias was updated
    assert torch.equal(_saved_bias(interrupted), bias)

    from megatron_mea.checkpoint.hf.exporting import export_hf_checkpoint
    from tests.checkpoint._hf_models import hf_logits
    from tests.checkpoint._megatron import megatron_logits
    from tests.checkpoint.test_megatron_lm_checkpoints import _load_hf

    out = str(tmp_path / "hf")
    assert export_hf_checkpoint(full, out) == "native"
    model = _load_hf(out)
    assert type(model.model.layers[0].mlp).__name__ == "MegatronMoeBlock"
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(hf_logits(model, ids), megatron_logits(full, ids),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("flag, value", [("--moe-router-score-function", "tanh"),
                                         ("--moe-router-dtype", "fp16")])
def test_router_flags_take_only_megatron_values(flag, value):
    from megatron_mea.apps.training.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args([*ROUTER, flag, value])
