"""Malformed or mismatched inputs are refused with a one-line message naming the file and the
tensor (and shapes) or config field, and leave nothing behind: no checkpoint, no empty directory.
Outputs must be new or empty directories."""

import os
import shutil

import pytest
import torch

from megatron_mea.checkpoint.hf.exporting import export_hf_checkpoint
from megatron_mea.checkpoint.hf.importing import import_hf_checkpoint
from megatron_mea.checkpoint.errors import CheckpointError, ConversionError
from megatron_mea.checkpoint.torch_dist.layout import TRACKER
from megatron_mea.checkpoint.torch_dist.layerwise import write_checkpoint
from megatron_mea.checkpoint.torch_dist.model_only import ModelDescription, converter_process
from tests.checkpoint._hf_models import edited_copy, hf_config


def _leftovers(directory):
    """Names under `directory` that a failed conversion might have left (staged outputs)."""
    return sorted(name for name in os.listdir(directory) if ".partial-" in name)


def _refused(source, tmp_path, match):
    out = tmp_path / "new" / "out"  # the parent is created for the output, then removed again
    with pytest.raises(ConversionError, match=match):
        import_hf_checkpoint(source, str(out))
    assert not (tmp_path / "new").exists() and _leftovers(tmp_path) == []


TENSOR_EDITS = {
    "missing": (lambda t: t.pop("model.layers.1.mlp.down_proj.weight"),
                r"'model\.layers\.1\.mlp\.down_proj\.weight' \[64, 96\] is missing"),
    "wrong-shape": (
        lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)}),
        r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \[16, 64\], the model config "
        r"implies \[32, 64\]",
    ),
    "unexpected": (lambda t: t.update({"model.layers.0.self_attn.extra.weight": torch.zeros(2)}),
                   r"not part of the model .*'model\.layers\.0\.self_attn\.extra\.weight' \[2\]"),
    "integer-dtype": (
        lambda t: t.update({"model.layers.1.mlp.up_proj.weight": torch.ones(96, 64).int()}),
        r"'model\.layers\.1\.mlp\.up_proj\.weight' has dtype int32; only floating-point",
    ),
}


@pytest.mark.parametrize("case", sorted(TENSOR_EDITS))
def test_hf_tensor_problems_are_named(checkpoints, tmp_path, case):
    edit, match = TENSOR_EDITS[case]
    source = edited_copy(checkpoints.hf("qwen3")[0], str(tmp_path / "hf"), edit_tensors=edit)
    _refused(source, tmp_path, match)


CONFIG_EDITS = {
    "activation": (lambda c: c.update(hidden_act="gelu"), r"hidden_act \('gelu'\)"),
    "rope-scaling": (lambda c: c.update(rope_parameters={
        "rope_type": "dynamic", "rope_theta": 5e5, "factor": 8.0}),
        r"rope_parameters\.rope_type \('dynamic'\) is not supported"),
    "family": (lambda c: c.update(model_type="gpt2"), r"model_type 'gpt2' is not supported"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_EDITS))
def test_unsupported_hf_configs_are_named(checkpoints, tmp_path, case):
    edit, match = CONFIG_EDITS[case]
    source = edited_copy(checkpoints.hf("llama")[0], str(tmp_path / "hf"), edit_config=edit)
    with pytest.raises((ConversionError, ValueError), match=match):
        import_hf_checkpoint(source, str(tmp_path / "out"))


def _break_json(path):
    with open(path, "w") as handle:
        handle.write('{"model_type": "llama", "hidden_size": 64,,}')


# What transformers' loader would answer with a multi-line traceback (invalid JSON, a wrong
# type) or accept with its class default (a missing size), named in one line.
MALFORMED_CONFIGS = {
    "invalid-json": (None, r"config\.json: invalid JSON \(Expecting property name enclosed in "
                           r"double quotes at line 1 column 43\)"),
    "missing-layers": (lambda c: c.pop("num_hidden_layers"),
                       r"config\.json: field 'num_hidden_layers' is missing"),
    "null-vocab": (lambda c: c.update(vocab_size=None),
                   r"config\.json: field 'vocab_size' is null"),
    "string-for-int": (lambda c: c.update(hidden_size="64"),
                       r"config\.json: field 'hidden_size' must be an integer, got '64'"),
    "bool-for-int": (lambda c: c.update(num_key_value_heads=True),
                     r"config\.json: field 'num_key_value_heads' must be an integer, got True"),
    "string-for-float": (lambda c: c.update(rms_norm_eps="1e-6"),
                         r"config\.json: field 'rms_norm_eps' must be a number, got '1e-6'"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_CONFIGS))
def test_malformed_config_json_is_named_in_one_line(checkpoints, tmp_path, case):
    edit, match = MALFORMED_CONFIGS[case]
    source = edited_copy(checkpoints.hf("llama")[0], str(tmp_path / "hf"), edit_config=edit)
    if edit is None:
        _break_json(os.path.join(source, "config.json"))
    with pytest.raises(ConversionError, match=match) as refused:
        import_hf_checkpoint(source, str(tmp_path / "out"))
    assert str(refused.value).startswith(os.path.join(source, "config.json"))
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "out").exists()


def test_transformers_validation_errors_are_one_line(checkpoints, tmp_path):
    # Caught by transformers' own validators (the layer_types list must match the layer count).
    source = edited_copy(checkpoints.hf("qwen3")[0], str(tmp_path / "hf"),
                         edit_config=lambda c: c.update(layer_types=["full_attention"] * 3))
    with pytest.raises(ConversionError, match=r"config\.json: .*layer_types") as refused:
        import_hf_checkpoint(source, str(tmp_path / "out"))
    assert "\n" not in str(refused.value) and not (tmp_path / "out").exists()


def test_outputs_must_be_new_or_empty_directories(checkpoints, tmp_path):
    hf_dir = checkpoints.hf("qwen3")[0]
    before = sorted(os.listdir(hf_dir))
    with pytest.raises(ConversionError, match=r"not empty \(holds config\.json, .*\); the "
                                              r"output must be a new or empty directory"):
        import_hf_checkpoint(hf_dir, hf_dir)  # the input folder itself
    assert sorted(os.listdir(hf_dir)) == before
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConversionError, match="exists and is not a directory"):
        import_hf_checkpoint(hf_dir, str(tmp_path / "file"))
    # Refused before any work: a broken input is not even read.
    broken = edited_copy(hf_dir, str(tmp_path / "broken"), edit_config=lambda c: c.clear())
    with pytest.raises(ConversionError, match="not empty"):
        import_hf_checkpoint(broken, hf_dir)
    meg = checkpoints.imported("qwen3")
    with pytest.raises(ConversionError, match="not empty"):
        export_hf_checkpoint(meg, hf_dir)
    from megatron_mea.checkpoint.transforms.compress import compress_checkpoint

    with pytest.raises(ConversionError, match="not empty"):
        compress_checkpoint(meg, meg, 2)
    (tmp_path / "empty").mkdir()  # an empty directory is fine, and is filled
    import_hf_checkpoint(hf_dir, str(tmp_path / "empty"))
    assert (tmp_path / "empty" / TRACKER).exists() and _leftovers(tmp_path) == []


def test_export_refuses_a_reference_of_another_model_before_writing(checkpoints, tmp_path):
    reference = edited_copy(checkpoints.hf("qwen3")[0], str(tmp_path / "ref"),
                            edit_config=lambda c: c.update(num_hidden_layers=4,
                                                           layer_types=["full_attention"] * 4))
    with pytest.raises(ConversionError, match=r"ref/config\.json: num_hidden_layers is 4, the "
                                              r"checkpoint's model has 2"):
        export_hf_checkpoint(checkpoints.imported("qwen3"), str(tmp_path / "hf"),
                             reference=reference)
    assert sorted(os.listdir(tmp_path)) == ["ref"]


def test_a_failed_export_leaves_nothing(checkpoints, tmp_path, monkeypatch):
    from megatron_mea.checkpoint.hf import exporting as hf_export

    def fail(*args):
        raise OSError("disk full")

    # A failure at the last step (the last shard), after config.json and the tokenizer, still
    # removes everything.
    monkeypatch.setattr(hf_export.HFWriter, "close", fail)
    with pytest.raises(OSError, match="disk full"):
        export_hf_checkpoint(checkpoints.imported("qwen3"), str(tmp_path / "a" / "hf"))
    assert os.listdir(tmp_path) == []


def test_sliding_window_and_non_safetensors_are_refused(checkpoints, tmp_path):
    config = hf_config("qwen2", use_sliding_window=True, sliding_window=8)
    (tmp_path / "sw").mkdir()
    config.save_pretrained(str(tmp_path / "sw"))
    with pytest.raises(ConversionError, match="use_sliding_window"):
        import_hf_checkpoint(str(tmp_path / "sw"), str(tmp_path / "out"))
    (tmp_path / "bin").mkdir()
    hf_config("qwen2").save_pretrained(str(tmp_path / "bin"))
    torch.save({}, tmp_path / "bin" / "pytorch_model.bin")
    with pytest.raises(ConversionError, match="only safetensors"):
        import_hf_checkpoint(str(tmp_path / "bin"), str(tmp_path / "out"))
    with pytest.raises(ConversionError, match="config.json: missing"):
        import_hf_checkpoint(str(tmp_path / "nothing"), str(tmp_path / "out"))
    (tmp_path / "bin" / "model.safetensors.index.json").write_text('{"weight_map": {')
    with pytest.raises(ConversionError, match=r"model\.safetensors\.index\.json: invalid JSON"):
        import_hf_checkpoint(str(tmp_path / "bin"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_megatron_checkpoint_not_matching_its_config_is_refused(checkpoints, tmp_path):
    root = str(tmp_path / "meg")
    shutil.copytree(checkpoints.imported("qwen3"), root)
    description = ModelDescription.load(root)
    description.args.num_query_groups = 2
    description.save(root)
    with pytest.raises(CheckpointError, match=r"linear_qkv.weight' has shape \[2, 128, 64\] in "
                                              r"the checkpoint, this model expects \[2, 96, 64\]"):
        export_hf_checkpoint(root, str(tmp_path / "hf"))


def test_partial_megatron_checkpoints_are_refused(checkpoints, tmp_path):
    root = tmp_path / "meg"
    shutil.copytree(checkpoints.imported("qwen3"), root)
    shard = next(p for p in (root / "iter_0000000").iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="truncated"):
        export_hf_checkpoint(str(root), str(tmp_path / "hf"))
    (root / TRACKER).unlink()
    with pytest.raises(ConversionError, match="no latest_checkpointed_iteration.txt"):
        export_hf_checkpoint(str(root), str(tmp_path / "hf2"))


def test_writer_checks_every_tensor_against_the_model(checkpoints, tmp_path):
    description = ModelDescription.load(checkpoints.imported("llama"))
    with converter_process():
        with pytest.raises(ConversionError, match=r"'embedding.word_embeddings.weight' has shape "
                                                  r"\[95, 64\], the model expects \[128, 64\]"):
            write_checkpoint(str(tmp_path / "a"), description,
                             [{"embedding.word_embeddings.weight": torch.zeros(95, 64)}])
        with pytest.raises(ConversionError, match=r"model tensors were not produced, e.g. "
                                                  r"'embedding.word_embeddings.weight' \[128, 64\]"):
            write_checkpoint(str(tmp_path / "b"), description, [])
        with pytest.raises(ConversionError, match="'decoder.layers.9.x' .* is not in the model"):
            write_checkpoint(str(tmp_path / "c"), description,
                             [{"decoder.layers.9.x": torch.zeros(1)}])
    assert os.listdir(tmp_path) == []  # no directory, no staged leftovers
    with pytest.raises(ConversionError, match="not empty"):
        import_hf_checkpoint(checkpoints.hf("llama")[0], checkpoints.imported("llama"))


def test_cli_reports_refusals_with_exit_status_2(checkpoints, tmp_path, capsys):
    from megatron_mea.cli.convert import main

    source = edited_copy(checkpoints.hf("llama")[0], str(tmp_path / "hf"),
                          edit_config=lambda c: c.update(hidden_act="gelu"))
    assert main(["--quiet", "import-hf", "--hf-dir", source, "--save", str(tmp_path / "o")]) == 2
    assert "mea-convert: error: hidden_act ('gelu') is not supported" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        main(["import-hf", "--save", str(tmp_path / "o")])
    assert usage.value.code == 2


def test_models_no_family_can_express_are_not_exported(checkpoints, tmp_path):
    root = str(tmp_path / "meg")
    shutil.copytree(checkpoints.imported("llama"), root)
    description = ModelDescription.load(root)
    description.args.swiglu = False
    description.save(root)
    with pytest.raises(ConversionError, match=r"swiglu \(False\) cannot be exported"):
        export_hf_checkpoint(root, str(tmp_path / "hf"))
