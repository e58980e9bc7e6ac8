"""Malformed or mismatched inputs are refused with a message naming the tensor (and shapes) or
the config field, and leave no loadable checkpoint behind."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_mea.checkpoint import (
    ConversionError,
    export_hf_checkpoint,
    import_hf_checkpoint,
    write_checkpoint,
)
from megatron_mea.checkpoint.megatron_io import ModelDescription, converter_process
from megatron_mea.training.checkpointing import TRACKER, CheckpointError
from tests.checkpoint._hf_models import hf_config


def _edited_copy(hf_dir, destination, edit_tensors=None, edit_config=None):
    shutil.copytree(hf_dir, destination)
    if edit_tensors:
        path = os.path.join(destination, "model.safetensors")
        tensors = load_file(path)
        edit_tensors(tensors)
        save_file(tensors, path, metadata={"format": "pt"})
    if edit_config:
        path = os.path.join(destination, "config.json")
        with open(path) as handle:
            config = json.load(handle)
        edit_config(config)
        with open(path, "w") as handle:
            json.dump(config, handle)
    return destination


def _refused(source, tmp_path, match):
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match=match):
        import_hf_checkpoint(source, str(out))
    assert not (out / TRACKER).exists() and not (out / "iter_0000000.tmp").exists()


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
}


@pytest.mark.parametrize("case", sorted(TENSOR_EDITS))
def test_hf_tensor_problems_are_named(checkpoints, tmp_path, case):
    edit, match = TENSOR_EDITS[case]
    source = _edited_copy(checkpoints.hf("qwen3")[0], str(tmp_path / "hf"), edit_tensors=edit)
    _refused(source, tmp_path, match)


CONFIG_EDITS = {
    "activation": (lambda c: c.update(hidden_act="gelu"), r"hidden_act \('gelu'\)"),
    "rope-scaling": (lambda c: c.update(rope_parameters={
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        r"rope_type \('llama3'\)"),
    "family": (lambda c: c.update(model_type="gpt2"), r"model_type 'gpt2' is not supported"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_EDITS))
def test_unsupported_hf_configs_are_named(checkpoints, tmp_path, case):
    edit, match = CONFIG_EDITS[case]
    source = _edited_copy(checkpoints.hf("llama")[0], str(tmp_path / "hf"), edit_config=edit)
    with pytest.raises((ConversionError, ValueError), match=match):
        import_hf_checkpoint(source, str(tmp_path / "out"))


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
                                                  r"\[95, 64\], the model expects \[96, 64\]"):
            write_checkpoint(str(tmp_path / "a"), description,
                             [{"embedding.word_embeddings.weight": torch.zeros(95, 64)}])
        with pytest.raises(ConversionError, match=r"model tensors were not produced, e.g. "
                                                  r"'embedding.word_embeddings.weight' \[96, 64\]"):
            write_checkpoint(str(tmp_path / "b"), description, [])
        with pytest.raises(ConversionError, match="'decoder.layers.9.x' .* is not in the model"):
            write_checkpoint(str(tmp_path / "c"), description,
                             [{"decoder.layers.9.x": torch.zeros(1)}])
    with pytest.raises(ConversionError, match="already holds a checkpoint"):
        import_hf_checkpoint(checkpoints.hf("llama")[0], checkpoints.imported("llama"))


def test_cli_reports_refusals_with_exit_status_1(checkpoints, tmp_path, capsys):
    from tests.checkpoint._megatron import convert_cli

    main = convert_cli().main

    source = _edited_copy(checkpoints.hf("llama")[0], str(tmp_path / "hf"),
                          edit_config=lambda c: c.update(hidden_act="gelu"))
    assert main(["--quiet", "import-hf", "--hf-dir", source, "--save", str(tmp_path / "o")]) == 1
    assert "error: hidden_act ('gelu') is not supported" in capsys.readouterr().err
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
