"""Llama 3.x `llama3` RoPE scaling: imported as Megatron's `rope_scaling` + `rope_scaling_factor`
(the imported model computes transformers' logits), exported back to the same config and
weights, honoured by the native (MEA / KHA) export; what Megatron cannot express is refused."""

import json
import os

import pytest
import torch
import yaml

from megatron_mea.checkpoint.hf.exporting import export_hf_checkpoint
from megatron_mea.checkpoint.hf.importing import import_hf_checkpoint
from megatron_mea.checkpoint.errors import ConversionError
from tests.checkpoint._hf_models import (
    LLAMA3,
    assert_same_hf_checkpoint,
    build_hf_model,
    edited_copy,
    hf_logits,
    llama3_rope,
    save_hf_model,
    tokens,
)
from tests.checkpoint._megatron import megatron_logits, perturb_plugin_params

ATOL = 1e-4
LONG = 128  # positions: the scaled frequencies turn far enough to change the logits


@pytest.fixture(scope="module")
def llama3(tmp_path_factory, single_rank):
    """(HF directory, HF model, Megatron import) of a tiny Llama with llama3 RoPE scaling."""
    root = tmp_path_factory.mktemp("llama3")
    model = build_hf_model("llama", **LLAMA3)
    hf_dir = save_hf_model(model, str(root / "hf"))
    meg = str(root / "meg")
    import_hf_checkpoint(hf_dir, meg)
    return hf_dir, model, meg


def test_imported_model_computes_the_scaled_hf_logits(llama3):
    hf_dir, model, meg = llama3
    with open(os.path.join(meg, "config.yaml")) as handle:
        args = yaml.safe_load(handle)
    assert (args["use_rope_scaling"], args["rope_scaling_factor"]) == (True, 32.0)
    ids = tokens(seq=LONG)
    got = megatron_logits(meg, ids)
    torch.testing.assert_close(got, hf_logits(model, ids), atol=ATOL, rtol=1e-4)
    # Guard: the same weights with plain RoPE give other logits, so the scaling was applied.
    plain = build_hf_model("llama", max_position_embeddings=LLAMA3["max_position_embeddings"])
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), model.parameters()))
    assert (got - hf_logits(plain, ids)).abs().max() > 1e-3


def test_round_trip_gives_back_the_rope_parameters_and_weights(llama3, tmp_path):
    hf_dir, _, meg = llama3
    out = str(tmp_path / "hf")
    export_hf_checkpoint(meg, out)
    with open(os.path.join(out, "config.json")) as handle:
        assert json.load(handle)["rope_parameters"] == llama3_rope()
    assert_same_hf_checkpoint(hf_dir, out)


def test_native_export_applies_the_scaling(llama3, tmp_path):
    from transformers import AutoModelForCausalLM

    # AutoModelForCausalLM learns the native types.
    import megatron_mea.integrations.transformers  # noqa: F401

    hf_dir, _, _ = llama3
    meg = str(tmp_path / "meg")
    import_hf_checkpoint(hf_dir, meg, attention_variant="mea", mea_head_norm=True)
    trained = perturb_plugin_params(meg, str(tmp_path / "trained"))
    out = str(tmp_path / "hf")
    assert export_hf_checkpoint(trained, out) == "native"
    model = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert model.config.rope_parameters == llama3_rope()
    ids = tokens(seq=LONG)
    torch.testing.assert_close(hf_logits(model, ids), megatron_logits(trained, ids),
                               atol=ATOL, rtol=1e-4)


REFUSED = {
    "low-freq-factor": (dict(low_freq_factor=2.0),
                        r"rope_parameters\.low_freq_factor \(2\.0\) is not supported: Megatron's "
                        r"llama3 RoPE scaling fixes it at 1\.0"),
    "original-context": (dict(original_max_position_embeddings=64),
                         r"rope_parameters\.original_max_position_embeddings \(64\) .* fixes it "
                         r"at 8192"),
    "yarn": (dict(rope_type="yarn"), r"rope_parameters\.rope_type \('yarn'\) is not supported"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_scaling_megatron_cannot_express_is_refused(llama3, tmp_path, case):
    changes, match = REFUSED[case]
    source = edited_copy(llama3[0], str(tmp_path / "hf"), edit_config=lambda c: c.update(
        rope_parameters=llama3_rope(**changes)))
    with pytest.raises(ConversionError, match=match) as refused:
        import_hf_checkpoint(source, str(tmp_path / "out"))
    assert "\n" not in str(refused.value) and not (tmp_path / "out").exists()
