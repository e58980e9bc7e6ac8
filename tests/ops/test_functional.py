"""The math functions against their definitions written as explicit loops (fp64)."""

import pytest
import torch

from megatron_mea.checkpoint.transforms.fold import fold_head_mix, fold_kha_linear
from megatron_mea.ops import (
    fuse_qkv,
    head_mix,
    head_rms_norm,
    kha_linear,
    kha_mlp,
    mix_init,
    unfuse_qkv,
)


def test_head_mix_is_sum_over_components():
    x = torch.randn(5, 3, 4, 6, dtype=torch.float64)  # [s, b, nc, hn]
    mix = torch.randn(4, 7, dtype=torch.float64)  # [nc, ng]
    out = head_mix(x, mix)
    expected = torch.zeros(5, 3, 7, 6, dtype=torch.float64)
    for h in range(7):
        for j in range(4):
            expected[:, :, h] += x[:, :, j] * mix[j, h]
    torch.testing.assert_close(out, expected)


def test_head_mix_stacked_matches_separate_k_and_v():
    k, v = torch.randn(2, 9, 3, 5, dtype=torch.float64).unbind(0)
    mix_k, mix_v = torch.randn(2, 3, 6, dtype=torch.float64).unbind(0)
    stacked = head_mix(torch.stack([k, v], dim=1), torch.stack([mix_k, mix_v]))
    torch.testing.assert_close(stacked[:, 0], head_mix(k, mix_k))
    torch.testing.assert_close(stacked[:, 1], head_mix(v, mix_v))


def test_head_rms_norm_normalises_each_head_separately():
    x = torch.randn(4, 2, 3, 8, dtype=torch.float64) * torch.tensor([0.1, 1.0, 30.0]).view(3, 1)
    weight = torch.randn(3, 8, dtype=torch.float64)
    out = head_rms_norm(x, weight, eps=1e-6)
    for head in range(3):
        xh = x[:, :, head]
        rms = (xh.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
        torch.testing.assert_close(out[:, :, head], xh / rms * weight[head])


def test_head_rms_norm_computes_in_fp32_and_returns_input_dtype():
    x = torch.randn(3, 2, 4, 8, dtype=torch.bfloat16) * 100
    out = head_rms_norm(x, torch.ones(4, 8), eps=1e-5)
    assert out.dtype == torch.bfloat16
    expected = head_rms_norm(x.float(), torch.ones(4, 8), eps=1e-5).bfloat16()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_kha_linear_applies_one_matrix_to_every_head():
    x = torch.randn(5, 2, 3, 4, dtype=torch.float64)
    t = torch.randn(4, 4, dtype=torch.float64)
    out = kha_linear(x, t)
    for head in range(3):
        torch.testing.assert_close(out[:, :, head], x[:, :, head] @ t)


def test_kha_mlp_definition_and_exact_identity_at_init():
    x = torch.randn(5, 2, 3, 4, dtype=torch.float64)
    up, gate, down = torch.randn(3, 4, 4, dtype=torch.float64).unbind(0)
    expected = 2 * ((x @ up) * torch.sigmoid(x @ gate)) @ down
    torch.testing.assert_close(kha_mlp(x, up, gate, down), expected)
    x32 = torch.randn(7, 3, 2, 16)
    eye, zero = torch.eye(16), torch.zeros(16, 16)
    assert torch.equal(kha_mlp(x32, eye, zero, eye), x32)
    assert torch.equal(kha_linear(x32, eye), x32)


@pytest.mark.parametrize("nc,ng", [(4, 4), (2, 4), (1, 3), (3, 6)])
def test_repeat_init_is_gqa_with_nc_groups(nc, ng):
    mix = mix_init("repeat", nc, ng)
    x = torch.randn(2, nc, 5)
    out = head_mix(x, mix)
    for h in range(ng):
        assert torch.equal(out[:, h], x[:, h * nc // ng])


def test_identity_and_normal_init():
    assert torch.equal(mix_init("identity", 3, 3), torch.eye(3))
    torch.manual_seed(0)
    normal = mix_init("normal", 64, 128)
    assert normal.shape == (64, 128)
    assert abs(normal.std().item() - 64**-0.5) < 0.01
    with pytest.raises(ValueError, match="nc == ng"):
        mix_init("identity", 2, 4)


def test_gradients_of_every_op_pass_gradcheck():
    x = torch.randn(3, 2, 4, dtype=torch.float64, requires_grad=True)
    mix = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    t = torch.randn(3, 4, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(head_mix, (x, mix))
    assert torch.autograd.gradcheck(lambda a, b: head_rms_norm(a, b, 1e-6), (x, w))
    assert torch.autograd.gradcheck(kha_linear, (x, t[0]))
    assert torch.autograd.gradcheck(kha_mlp, (x, t[0], t[1], t[2]))


def test_qkv_layout_round_trip_and_folds():
    np_, ng, hn, h = 6, 3, 4, 5
    fused = torch.randn(ng * (np_ // ng + 2) * hn, h, dtype=torch.float64)
    q, k, v = unfuse_qkv(fused, np_, ng, hn)
    assert torch.equal(fuse_qkv(q, k, v), fused)
    x = torch.randn(7, h, dtype=torch.float64)
    mix = torch.randn(ng, 5, dtype=torch.float64)
    # Projection with the folded weight == HLC of the projected components.
    per_head = torch.einsum("ti,jdi->tjd", x, k)
    folded = torch.einsum("ti,hdi->thd", x, fold_head_mix(k, mix))
    torch.testing.assert_close(folded, head_mix(per_head, mix))
    t = torch.randn(hn, hn, dtype=torch.float64)
    q_heads = torch.einsum("ti,ndi->tnd", x, q)
    torch.testing.assert_close(
        torch.einsum("ti,ndi->tnd", x, fold_kha_linear(q, t)), kha_linear(q_heads, t)
    )


def test_qkv_layout_of_activations_matches_the_weight_rows():
    # linear_qkv's output features follow its weight rows: splitting the output (dim=-1) equals
    # projecting with each unfused weight; bias rows unfuse alike (no trailing dims).
    np_, ng, hn, h = 8, 2, 3, 5
    weight = torch.randn(ng * (np_ // ng + 2) * hn, h, dtype=torch.float64)
    bias = torch.randn(weight.shape[0], dtype=torch.float64)
    x = torch.randn(4, 2, h, dtype=torch.float64)  # [s, b, h]
    out = torch.nn.functional.linear(x, weight, bias)
    parts = zip(unfuse_qkv(out, np_, ng, hn, dim=-1), unfuse_qkv(weight, np_, ng, hn),
                unfuse_qkv(bias, np_, ng, hn))
    for got, rows, bias_rows in parts:
        expected = torch.einsum("sbi,ndi->sbnd", x, rows) + bias_rows
        torch.testing.assert_close(got, expected)
    # Group 1 of 2: query heads 4..7, then its key head, then its value head.
    q, k, v = unfuse_qkv(weight, np_, ng, hn)
    per_group = (np_ // ng + 2) * hn
    assert torch.equal(q[4], weight[per_group : per_group + hn])
    assert torch.equal(k[1], weight[2 * per_group - 2 * hn : 2 * per_group - hn])
    assert torch.equal(v[1], weight[2 * per_group - hn :])
    assert torch.equal(fuse_qkv(*unfuse_qkv(out, np_, ng, hn, dim=-1), dim=2), out)


@pytest.mark.parametrize("np_,ng", [(8, 2), (4, 4), (6, 1)], ids=["gqa", "mha", "mqa"])
def test_unfuse_qkv_gradients_equal_row_indexing_and_key_value_are_views(np_, ng):
    # The split's backward (one cat) against gathering the same rows by explicit index.
    hn, per_group = 3, np_ // ng + 2
    fused = torch.randn(5, 2, ng * per_group * hn, dtype=torch.float64, requires_grad=True)
    q, k, v = unfuse_qkv(fused, np_, ng, hn, dim=-1)
    assert k._base is not None and v._base is not None  # views of the projection output
    rows = torch.arange(fused.shape[-1]).view(ng, per_group, hn)
    q_rows = rows[:, : np_ // ng].reshape(np_, hn)
    ups = [torch.randn_like(t) for t in (q, k, v)]
    got = torch.autograd.grad((q, k, v), fused, ups)[0]
    expected = torch.autograd.grad(
        (fused[..., q_rows], fused[..., rows[:, -2]], fused[..., rows[:, -1]]), fused, ups
    )[0]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    for part, index in zip((q, k, v), (q_rows, rows[:, -2], rows[:, -1])):
        assert torch.equal(part, fused[..., index])
