"""Exports of the variants: folded into stock architectures (MEA without head norm, KHA-Linear)
and through our modeling code (MEA with head norm, KHA-MLP) give the Megatron variant's logits."""

import os

import pytest
import torch

from megatron_mea.checkpoint.hf.exporting import export_hf_checkpoint
from megatron_mea.checkpoint.hf.importing import import_hf_checkpoint
from megatron_mea.checkpoint.errors import ConversionError
from megatron_mea.checkpoint.torch_dist.layerwise import read_checkpoint
from tests.checkpoint._hf_models import hf_logits, tokens
from tests.checkpoint._megatron import megatron_logits, perturb_plugin_params

ATOL = 1e-4


def load_hf(directory):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()


FOLDED = [
    ("qwen3", "mea", {}),  # k_norm after the folded mixing
    ("qwen2", "mea", {}),  # biases fold too
    ("llama", "kha", {}),
    ("qwen3_moe", "kha", {"kha_variant": "linear", "kha_targets": ["q", "v"]}),
]


@pytest.mark.parametrize("family,variant,options", FOLDED,
                         ids=[f"{f}-{v}" for f, v, _ in FOLDED])
def test_folded_export_is_a_stock_model_with_the_variant_logits(
    checkpoints, tmp_path, family, variant, options
):
    trained = perturb_plugin_params(checkpoints.imported(family, variant, **options),
                                    str(tmp_path / "trained"))
    out = str(tmp_path / "hf")
    assert export_hf_checkpoint(trained, out) == "plain"
    model = load_hf(out)
    assert type(model).__name__ == checkpoints.hf(family)[1].__class__.__name__
    ids = tokens()
    expected = megatron_logits(trained, ids)
    torch.testing.assert_close(hf_logits(model, ids), expected, atol=ATOL, rtol=1e-4)
    # Guard: the perturbed variant is not the imported baseline any more.
    assert (expected - hf_logits(checkpoints.hf(family)[1], ids)).abs().max() > 1e-2


NATIVE = [
    ("qwen3", "mea", {"mea_head_norm": True}),
    ("llama", "mea", {"mea_head_norm": True, "mea_hlc": False}),  # the "+norm" control
    ("mixtral", "mea", {"mea_head_norm": True}),
    ("qwen2", "kha", {"kha_variant": "mlp"}),
    ("qwen3_moe", "kha", {"kha_variant": "mlp"}),
    # The KHA paper's ablations: the MLP on q, k and v; the gate alone.
    ("qwen3", "kha", {"kha_variant": "mlp", "kha_targets": ["q", "k", "v"]}),
    ("llama", "kha", {"kha_variant": "gate", "kha_targets": ["q", "v"]}),
]


@pytest.mark.parametrize("family,variant,options", NATIVE,
                         ids=[f"{f}-{v}" for f, v, _ in NATIVE])
def test_native_export_has_the_variant_logits_and_round_trips(
    checkpoints, tmp_path, family, variant, options
):
    # AutoModelForCausalLM learns the native types.
    import megatron_mea.integrations.transformers  # noqa: F401

    trained = perturb_plugin_params(checkpoints.imported(family, variant, **options),
                                    str(tmp_path / "trained"))
    with pytest.raises(ConversionError, match="does not fold"):
        export_hf_checkpoint(trained, str(tmp_path / "plain"), format="plain")
    out = str(tmp_path / "hf")
    assert export_hf_checkpoint(trained, out) == "native"
    assert os.path.exists(os.path.join(out, "modeling_megatron_mea.py"))
    ids = tokens()
    torch.testing.assert_close(hf_logits(load_hf(out), ids), megatron_logits(trained, ids),
                               atol=ATOL, rtol=1e-4)
    # The native export imports back to the same Megatron tensors.
    again = str(tmp_path / "again")
    import_hf_checkpoint(out, again)
    _, first = read_checkpoint(trained)
    _, second = read_checkpoint(again)
    for (_, a), (_, b) in zip(first, second, strict=True):
        assert sorted(a) == sorted(b)
        for name in a:
            assert torch.equal(a[name], b[name]), name


def test_native_config_carries_every_variant_field_as_the_training_config_resolved(
    checkpoints, tmp_path
):
    """The native config.json holds the Megatron config's resolved variant fields (the KHA
    default for MoE models included), and the modeling code has no defaults of its own."""
    import json

    from megatron_mea.checkpoint.hf.config import VARIANT_FIELDS
    from megatron_mea.checkpoint.torch_dist.model_only import ModelDescription
    from megatron_mea.integrations.transformers.modeling_megatron_mea import variant_setting

    source = checkpoints.imported("qwen3_moe", "kha")  # kha_variant left to the default
    out = str(tmp_path / "hf")
    export_hf_checkpoint(source, out, format="native")
    with open(os.path.join(out, "config.json"), encoding="utf-8") as handle:
        written = json.load(handle)
    config = ModelDescription.load(source).config
    assert config.kha_variant == "mlp"
    for name in VARIANT_FIELDS:
        value = getattr(config, name)
        assert written[name] == (list(value) if isinstance(value, tuple) else value), name
    with pytest.raises(ValueError, match="has no kha_variant"):
        variant_setting(type("Config", (), {"kha_variant": None})(), "kha_variant")


def test_native_export_loads_with_trust_remote_code(checkpoints, tmp_path):
    import subprocess
    import sys

    out = str(tmp_path / "hf")
    export_hf_checkpoint(checkpoints.imported("qwen3", "kha", kha_variant="mlp"), out)
    # A fresh interpreter that never imports megatron_mea: the export's own files suffice.
    code = (
        "import sys, torch; from transformers import AutoModelForCausalLM; "
        f"m = AutoModelForCausalLM.from_pretrained({out!r}, trust_remote_code=True); "
        "m(torch.tensor([[1, 2, 3]])); "
        "assert 'megatron_mea' not in sys.modules; print(type(m).__name__)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=str(tmp_path), env={**os.environ, "PYTHONPATH": ""}, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "MegatronMEAQwen3ForCausalLM" in result.stdout


def _cache_elements(model, ids):
    with torch.no_grad():
        cache = model(ids, use_cache=True).cache
    return sum(layer.keys.numel() + layer.values.numel() for layer in cache.layers)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_native_export_generates_from_a_component_cache_of_half_the_baseline(
    checkpoints, tmp_path, attention
):
    from transformers import AutoModelForCausalLM

    from megatron_mea.checkpoint.transforms.compress import compress_checkpoint

    trained = perturb_plugin_params(checkpoints.imported("qwen3", "mea", mea_head_norm=True),
                                    str(tmp_path / "trained"))
    compressed = str(tmp_path / "nc2")
    compress_checkpoint(trained, compressed, 2)  # 2 components for the 4 K/V heads
    out = str(tmp_path / "hf")
    assert export_hf_checkpoint(compressed, out) == "native"
    model = AutoModelForCausalLM.from_pretrained(
        out, trust_remote_code=True, attn_implementation=attention
    ).eval()
    ids = tokens()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded row: the cache path honours the padding mask too
    settings = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                    output_scores=True, return_dict_in_generate=True)
    cached = model.generate(ids, **settings)
    uncached = model.generate(ids, use_cache=False, **settings)
    assert torch.equal(cached.sequences, uncached.sequences)
    for got, want in zip(cached.scores, uncached.scores, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # Per layer and token: 2 x 2 components of 8 channels and 4 inverse RMS (one per composite
    # key), against the baseline's 2 x 4 heads of 8.
    baseline = _cache_elements(checkpoints.hf("qwen3")[1], ids)
    b, t = ids.shape
    assert baseline == 2 * b * t * 2 * 4 * 8
    assert _cache_elements(model, ids) == baseline // 2 + 2 * b * t * 4


def test_native_norm_control_generates_from_its_cache(checkpoints, tmp_path):
    # The +norm control (head norm, no HLC) caches its K/V heads like the baseline; generating
    # with the cache gives the tokens and scores of generating without it.
    from transformers import AutoModelForCausalLM

    trained = perturb_plugin_params(
        checkpoints.imported("llama", "mea", mea_head_norm=True, mea_hlc=False),
        str(tmp_path / "trained"),
    )
    out = str(tmp_path / "hf")
    assert export_hf_checkpoint(trained, out) == "native"
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    settings = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, output_scores=True,
                    return_dict_in_generate=True)
    ids = tokens()
    cached = model.generate(ids, **settings)
    uncached = model.generate(ids, use_cache=False, **settings)
    assert torch.equal(cached.sequences, uncached.sequences)
    for got, want in zip(cached.scores, uncached.scores, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert _cache_elements(model, ids) == _cache_elements(checkpoints.hf("llama")[1], ids)
