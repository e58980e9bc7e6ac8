"""`mea-pretrain --core-attention sdpa` builds the model with torch's fused attention, which
computes what Megatron's default core attention computes (loss and every gradient)."""

import pytest
import torch

from megatron_mea.apps.training.arguments import parse_args
from megatron_mea.layers.sdpa_attention import SDPADotProductAttention
from megatron_mea.model.gpt import build_model, transformer_config
from tests._models import forward_loss

TINY = ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8",
        "--num-query-groups", "4", "--seq-length", "16", "--vocab-size", "96",
        "--make-vocab-size-divisible-by", "32", "--num-experts", "0"]


def _model(flags):
    args = parse_args([*TINY, *flags])
    torch.manual_seed(5)
    return build_model(args, transformer_config(args), pre_process=True, post_process=True)


def _loss_and_grads(model):
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 96, (2, 17), generator=gen)
    loss = forward_loss(model, tokens[:, :-1], tokens[:, 1:]).sum()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("variant", [[], ["--attention-variant", "mea"],
                                     ["--attention-variant", "kha"]], ids=["standard", "mea", "kha"])
def test_sdpa_core_attention_equals_megatrons(single_rank, variant):
    default = _model(variant)
    sdpa = _model([*variant, "--core-attention", "sdpa"])
    assert all(type(layer.self_attention.core_attention) is SDPADotProductAttention
               for layer in sdpa.decoder.layers)
    sdpa.load_state_dict(default.state_dict())
    loss_default, grads_default = _loss_and_grads(default)
    loss_sdpa, grads_sdpa = _loss_and_grads(sdpa)
    torch.testing.assert_close(loss_sdpa, loss_default, rtol=1e-5, atol=1e-5)
    assert grads_sdpa.keys() == grads_default.keys()
    for name, grad in grads_default.items():
        torch.testing.assert_close(grads_sdpa[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_sdpa_core_attention_is_refused_with_transformer_engine():
    with pytest.raises(ValueError, match=r"core_attention \('sdpa'\) needs transformer_impl=local"):
        parse_args([*TINY, "--core-attention", "sdpa", "--transformer-impl", "transformer_engine"])
