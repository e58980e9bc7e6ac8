"""bf16 MEA / KHA layers on the GPU against the fp32 layer with the same weights (within bf16
tolerance), and the fp32 GPU layer against the fp32 CPU layer (CUDA kernels vs the CPU-tested
path), with both core attentions of the local spec."""

import pytest
import torch

from tests.gpu._layers import (
    VARIANTS,
    build_layer,
    inputs,
    load,
    make_config,
    reference_state,
    rel,
    run,
)

# bf16 keeps 8 bits of mantissa (relative rounding 2^-9); a layer stacks a dozen rounded ops.
BF16_OUT, BF16_GRAD, BF16_PARAM_GRAD = 2e-2, 3e-2, 6e-2


@pytest.mark.gpu
@pytest.mark.parametrize("core_attention", ["megatron", "sdpa"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_bf16_layer_matches_fp32_layer(single_rank, variant, core_attention):
    state = reference_state(variant)
    fp32 = load(build_layer(make_config(variant), core_attention=core_attention), state)
    bf16 = load(build_layer(make_config(variant, torch.bfloat16), core_attention=core_attention),
                state)
    x, grad = inputs(torch.float32)
    out32, dx32, grads32 = run(fp32, x, grad)
    out16, dx16, grads16 = run(bf16, x.bfloat16(), grad.bfloat16())
    assert torch.isfinite(out16).all() and torch.isfinite(dx16).all()
    assert rel(out16, out32) < BF16_OUT
    assert rel(dx16, dx32) < BF16_GRAD
    assert grads16.keys() == grads32.keys()
    for name in grads32:
        assert torch.isfinite(grads16[name]).all(), name
        assert rel(grads16[name], grads32[name]) < BF16_PARAM_GRAD, name


@pytest.mark.gpu
@pytest.mark.parametrize("core_attention", ["megatron", "sdpa"])
@pytest.mark.parametrize("variant", ["baseline", "mea-virtual", "mea-weights",
                                     "kha-linear-folded", "kha-mlp"])
def test_fp32_gpu_layer_matches_the_cpu_layer(single_rank, variant, core_attention):
    state = reference_state(variant)
    gpu = load(build_layer(make_config(variant), core_attention=core_attention), state)
    # The CPU side always uses SDPA: Megatron's local attention builds its causal mask on "cuda"
    # whenever CUDA exists (tests/layers/test_sdpa_attention.py equates the two on the CPU).
    cpu = load(build_layer(make_config(variant), core_attention="sdpa", device="cpu"), state)
    x, grad = inputs(torch.float32)
    out_gpu, dx_gpu, grads_gpu = run(gpu, x, grad)
    out_cpu, dx_cpu, grads_cpu = run(cpu, x.cpu(), grad.cpu())
    # TF32 would round to 10 bits: make sure fp32 matmuls stay fp32 here.
    assert not torch.backends.cuda.matmul.allow_tf32
    assert rel(out_gpu, out_cpu) < 1e-4
    assert rel(dx_gpu, dx_cpu) < 1e-4
    for name in grads_cpu:
        assert rel(grads_gpu[name], grads_cpu[name]) < 1e-4, name
