"""The configuration a GPU run uses, built and run on the CPU: the fusions `mea-pretrain` picks
for CUDA must match what is installed (no Apex, no Transformer Engine here, as on a plain pip
install with a CUDA torch), so the model builds and trains instead of failing in Megatron."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_mea import _optional
from megatron_mea.apps.training.arguments import parse_args
from megatron_mea.model.fusions import fusion_settings
from megatron_mea.model.gpt import build_model, transformer_config

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A bf16 MoE run as mea-pretrain would build it on a GPU with the local spec and Megatron's core
# attention; sizes are multiples of 4 so that Megatron's fused-softmax kernel would be chosen.
GPU_RUN = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8",
           "--num-query-groups", "4", "--seq-length", "32", "--num-experts", "4",
           "--moe-router-topk", "2", "--moe-layer-freq", "[0,1]", "--bf16",
           "--micro-batch-size", "4", "--global-batch-size", "4", "--vocab-size", "128",
           "--train-iters", "1", "--mock-data"]


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("on_gpu,persist,softmax", [
    (False, True, True), (True, False, False), (True, True, False), (True, False, True),
    (True, True, True)])
def test_fusions_follow_the_installed_kernels(on_gpu, persist, softmax, normalization):
    fields = fusion_settings(on_gpu, normalization, have_persist_layer_norm=persist,
                             have_fused_softmax=softmax)
    assert fields["use_cpu_initialization"] is (not on_gpu)
    assert fields["masked_softmax_fusion"] is (on_gpu and softmax)
    # Apex's persistent kernel is a LayerNorm kernel; RMSNorm builds torch's norm, which refuses it.
    assert fields["persist_layer_norm"] is (on_gpu and persist and normalization == "LayerNorm")
    assert not fields["bias_dropout_fusion"] and not fields["gradient_accumulation_fusion"]
    assert not fields["apply_rope_fusion"]


def test_this_machine_has_neither_apex_nor_fused_softmax():
    # The tests below build what a GPU without Apex gets; they would prove nothing with Apex.
    assert not _optional.HAVE_APEX_PERSIST_LAYER_NORM and not _optional.HAVE_FUSED_SOFTMAX


@pytest.mark.parametrize("variant", [
    ["--attention-variant", "standard"],
    ["--attention-variant", "mea", "--mea-num-kv-components", "2"],
    ["--attention-variant", "kha"],
])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_gpu_configuration_builds_and_trains_in_bf16(single_rank, variant, normalization):
    args = parse_args([*GPU_RUN, "--normalization", normalization, *variant])
    config = transformer_config(args, on_gpu=True)
    assert config.bf16 and not config.use_cpu_initialization
    assert not config.persist_layer_norm and not config.masked_softmax_fusion
    model = build_model(args, config, pre_process=True, post_process=True)
    tokens = torch.randint(0, 128, (4, 32))
    positions = torch.arange(32).expand(4, 32)
    loss = model(tokens, positions, None, labels=tokens).float().mean()
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)


def test_gpu_configuration_softmax_runs_megatron_core_attention_in_bf16(single_rank):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    config = transformer_config(parse_args(GPU_RUN), on_gpu=True)
    attention = DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                    attention_type="self")
    q, k, v = (torch.randn(32, 4, heads, 8, dtype=torch.bfloat16) for heads in (8, 4, 4))
    out = attention(q, k, v, attention_mask=None)
    # The reference: plain causal softmax attention in fp32, the K/V groups repeated.
    k, v = (t.float().repeat_interleave(2, dim=2) for t in (k, v))
    scores = torch.einsum("sbhd,tbhd->bhst", q.float(), k) / 8 ** 0.5
    scores = scores.masked_fill(torch.ones(32, 32).triu(1).bool(), float("-inf"))
    expected = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v).reshape(32, 4, 64)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_moe_router_without_transformer_engine_outside_the_cpu_patches():
    # A fresh process that never enters megatron_on_cpu(): the router's gating matmul must run
    # once the plugin's spec is built (on 0.16 the name was unbound without TE, on any device).
    code = textwrap.dedent("""
        import torch
        from megatron.core.transformer.moe import moe_utils
        from megatron_mea import MEATransformerConfig, get_gpt_layer_spec

        config = MEATransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4,
                                      num_moe_experts=4, moe_router_topk=2,
                                      use_cpu_initialization=True)
        get_gpt_layer_spec(config, use_transformer_engine=False)
        inp, weight = torch.randn(6, 16), torch.randn(4, 16)
        out = moe_utils.router_gating_linear(inp, weight, None, torch.float32)
        torch.testing.assert_close(out, inp @ weight.t())
        print("gating ok")
    """)
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and "gating ok" in run.stdout, run.stderr[-3000:]
