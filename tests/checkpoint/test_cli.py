"""`tools/convert_checkpoint.py`: the command line runs the library's conversions."""

import os

import yaml
from safetensors.torch import load_file

from tests.checkpoint._megatron import convert_cli


def test_import_and_export_through_the_command_line(checkpoints, tmp_path, capsys):
    main = convert_cli().main
    hf_dir, _ = checkpoints.hf("mixtral")
    meg, out = str(tmp_path / "meg"), str(tmp_path / "hf")
    assert main(["--quiet", "import-hf", "--hf-dir", hf_dir, "--save", meg,
                 "--attention-variant", "kha", "--kha-variant", "linear",
                 "--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2"]) == 0
    with open(os.path.join(meg, "config.yaml")) as handle:
        args = yaml.safe_load(handle)
    assert (args["attention_variant"], args["kha_variant"]) == ("kha", "linear")
    assert (args["tensor_model_parallel_size"], args["expert_model_parallel_size"]) == (2, 2)
    assert main(["--quiet", "export-hf", "--load", meg, "--save", out]) == 0
    assert "plain format" in capsys.readouterr().out
    original = load_file(os.path.join(hf_dir, "model.safetensors"))
    exported = load_file(os.path.join(out, "model.safetensors"))
    assert sorted(original) == sorted(exported)  # identity KHA folds away exactly
    assert all((original[k] == exported[k]).all() for k in original)


def test_layouts_the_model_cannot_take_are_refused_at_import(checkpoints, tmp_path, capsys):
    main = convert_cli().main
    code = main(["--quiet", "import-hf", "--hf-dir", checkpoints.hf("qwen3")[0],
                 "--save", str(tmp_path / "meg"), "--attention-variant", "mea",
                 "--tensor-model-parallel-size", "8"])
    assert code == 1
    assert "must be divisible by tensor_model_parallel_size (8)" in capsys.readouterr().err
