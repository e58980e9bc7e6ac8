"""Per-layer attention variants (`attention_variant_per_layer`) and the head-norm-only MEA
control (`mea_hlc=False`), against plain models built from the same weights."""

import pytest
import torch
from megatron.core.transformer.attention import SelfAttention

from megatron_mea.layers import KHASelfAttention, MEASelfAttention
from tests._models import batch, build_gpt, forward_loss, perturb_plugin_params, tiny_config


def _losses_and_grads(model):
    model.zero_grad()
    loss = forward_loss(model, *batch()).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _copy_shared(source, target):
    """Copy every parameter `target` shares (by name) with `source`; return the names left."""
    theirs = dict(source.named_parameters())
    left = []
    with torch.no_grad():
        for name, param in target.named_parameters():
            if name in theirs:
                param.copy_(theirs[name])
            else:
                left.append(name)
    return left


@pytest.mark.parametrize("variant,cls", [("mea", MEASelfAttention), ("kha", KHASelfAttention)])
def test_each_layer_gets_the_class_of_its_variant(single_rank, variant, cls):
    config = tiny_config(variant, attention_variant_per_layer=("standard", variant))
    model = build_gpt(config)
    first, second = (layer.self_attention for layer in model.decoder.layers)
    assert type(first) is SelfAttention and type(second) is cls
    # Layers of different shapes are checkpointed under their own keys.
    assert config.hetereogenous_dist_checkpoint


def test_standard_layers_are_plain_attention_and_variant_layers_act(single_rank):
    """A (standard, MEA) model loaded with a plain model's weights computes the plain model
    exactly while its MEA layer is at the identity (no head norm), loss and every shared
    gradient; moving the MEA layer's matrices off the identity changes the loss."""
    plain = build_gpt(tiny_config("standard"))
    mixed = build_gpt(tiny_config(
        "mea", attention_variant_per_layer=("standard", "mea"), mea_head_norm=False))
    extra = _copy_shared(plain, mixed)
    assert extra and all(".layers.1.self_attention.head_mix." in name for name in extra), extra
    loss_plain, grads_plain = _losses_and_grads(plain)
    loss_mixed, grads_mixed = _losses_and_grads(mixed)
    torch.testing.assert_close(loss_mixed, loss_plain, rtol=0, atol=1e-6)
    for name, grad in grads_plain.items():
        torch.testing.assert_close(grads_mixed[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    perturb_plugin_params(mixed)
    assert abs(_losses_and_grads(mixed)[0] - loss_plain) > 1e-3


def test_per_layer_component_counts_apply_to_the_mea_layers_only(single_rank):
    config = tiny_config("mea", attention_variant_per_layer=("standard", "mea"),
                         mea_num_kv_components_per_layer=(4, 2))
    model = build_gpt(config)
    first, second = (layer.self_attention for layer in model.decoder.layers)
    assert type(first) is SelfAttention
    assert second.num_components == 2 and tuple(second.head_mix.key_weight.shape) == (2, 4)


def test_head_norm_only_control_has_no_composition(single_rank):
    """`mea_hlc=False`: no `head_mix`; the model equals MEA with identity HLC (same weights)."""
    control = build_gpt(tiny_config("mea", mea_hlc=False))
    full = build_gpt(tiny_config("mea"))
    assert not any("head_mix" in name for name, _ in control.named_parameters())
    assert any("head_norm" in name for name, _ in control.named_parameters())
    extra = _copy_shared(control, full)
    assert extra and all("head_mix" in name for name in extra)
    loss_control, grads_control = _losses_and_grads(control)
    loss_full, grads_full = _losses_and_grads(full)
    torch.testing.assert_close(loss_control, loss_full, rtol=0, atol=1e-6)
    for name, grad in grads_control.items():
        torch.testing.assert_close(grads_full[name], grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "fields,match",
    [
        (dict(attention_variant_per_layer=("standard",)), "has 1 entries, num_layers is 2"),
        (dict(attention_variant_per_layer=("mea", "kha")), "mixes"),
        (dict(attention_variant_per_layer=("standard", "mla")), "'mla'"),
        (dict(mea_hlc=False, mea_num_kv_components=2), "mea_hlc=False"),
        (dict(mea_hlc=False, mea_head_norm=False), "leaves nothing of MEA"),
    ],
)
def test_bad_per_layer_settings_name_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        tiny_config("mea", **fields)
