"""`mea-convert`: the command line runs the library's conversions."""

import os
import shutil

import pytest
import yaml
from safetensors.torch import load_file

from megatron_mea.cli.convert import main
from tests.checkpoint._hf_models import edited_copy

pytestmark = pytest.mark.slow


def test_import_and_export_through_the_command_line(checkpoints, tmp_path, capsys):
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
    printed = capsys.readouterr().out
    assert "plain format" in printed
    # The iteration read is on the console (a rewound run's directory may have held others).
    assert f"mea-convert export-hf: read iteration 0 from {meg}\n" in printed
    original = load_file(os.path.join(hf_dir, "model.safetensors"))
    exported = load_file(os.path.join(out, "model.safetensors"))
    assert sorted(original) == sorted(exported)  # identity KHA folds away exactly
    assert all((original[k] == exported[k]).all() for k in original)
    # --load may name the iter_XXXXXXX folder (as mea-generate and mea-eval take it)
    folder = str(tmp_path / "hf-from-folder")
    assert main(["--quiet", "export-hf", "--load", f"{meg}/iter_0000000", "--save", folder]) == 0
    again = load_file(os.path.join(folder, "model.safetensors"))
    assert all((again[k] == exported[k]).all() for k in exported)


def test_layouts_the_model_cannot_take_are_refused_at_import(checkpoints, tmp_path, capsys):
    code = main(["--quiet", "import-hf", "--hf-dir", checkpoints.hf("qwen3")[0],
                 "--save", str(tmp_path / "meg"), "--attention-variant", "mea",
                 "--tensor-model-parallel-size", "8"])
    assert code == 2
    assert "must be divisible by tensor_model_parallel_size (8)" in capsys.readouterr().err


def _one_error_line(capsys):
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("mea-convert: error: ")]
    assert len(lines) == 1, err
    return lines[0]


def test_refusals_are_one_line_and_leave_no_directory(checkpoints, tmp_path, capsys):
    hf_dir = checkpoints.hf("qwen3")[0]
    config = os.path.join(tmp_path, "bad", "config.json")
    save = str(tmp_path / "meg")
    for edit, message in (
        (lambda c: c.pop("num_hidden_layers"), "field 'num_hidden_layers' is missing"),
        (lambda c: c.update(hidden_size="64"), "field 'hidden_size' must be an integer, got '64'"),
    ):
        bad = edited_copy(hf_dir, str(tmp_path / "bad"), edit_config=edit)
        assert main(["--quiet", "import-hf", "--hf-dir", bad, "--save", save]) == 2
        assert _one_error_line(capsys) == f"mea-convert: error: {config}: {message}"
        assert sorted(os.listdir(tmp_path)) == ["bad"]  # no --save directory
        shutil.rmtree(bad)

    before = sorted(os.listdir(hf_dir))  # --save the input folder: refused, left as it was
    assert main(["--quiet", "import-hf", "--hf-dir", hf_dir, "--save", hf_dir]) == 2
    assert _one_error_line(capsys).startswith(f"mea-convert: error: {hf_dir}: not empty (holds config.json")
    assert sorted(os.listdir(hf_dir)) == before

    reference = edited_copy(hf_dir, str(tmp_path / "ref"), edit_config=lambda c: c.update(
        num_hidden_layers=3, layer_types=["full_attention"] * 3))
    assert main(["--quiet", "export-hf", "--load", checkpoints.imported("qwen3"),
                 "--save", str(tmp_path / "out"), "--reference", reference]) == 2
    assert "num_hidden_layers is 3, the checkpoint's model has 2" in _one_error_line(capsys)
    assert sorted(os.listdir(tmp_path)) == ["ref"]  # no weights without a config.json


def test_messages_name_what_is_wrong_and_quiet_goes_anywhere(checkpoints, tmp_path, capsys,
                                                             caplog):
    import logging

    from megatron_mea.cli.convert import build_parser
    from megatron_mea.inference.loading import find_run_checkpoint

    source = checkpoints.imported("qwen3")  # iteration 0
    missing = str(tmp_path / "no-such-run")
    out = str(tmp_path / "hf")
    assert main(["export-hf", "--load", missing, "--save", out, "--quiet"]) == 2
    assert _one_error_line(capsys) == f"mea-convert: error: {missing}: no such directory"
    assert main(["export-hf", "--load", source, "--ckpt-step", "999", "--save", out]) == 2
    assert _one_error_line(capsys) == (
        f"mea-convert: error: {source}/iter_0000999: no such checkpoint (iterations saved "
        "there: 0)")
    assert not os.path.exists(out)
    # mea-generate's loader says the same
    with pytest.raises(FileNotFoundError, match=f"^{missing}: no such directory$"):
        find_run_checkpoint(missing)
    with pytest.raises(FileNotFoundError, match=r"iter_0000999: no such checkpoint \(iterations "
                                                r"saved there: 0\)$"):
        find_run_checkpoint(source, 999)
    # the embedding and output layer are named, not "layer -1"
    with caplog.at_level(logging.INFO, logger="megatron_mea"):
        assert main(["export-hf", "--load", source, "--save", out]) == 0
    assert "exported the embedding, final norm and output layer" in caplog.text
    assert "layer -1" not in caplog.text
    # --quiet before or after the sub-command
    for argv in (["--quiet", "probe"], ["probe", "--quiet"], ["probe"]):
        args = build_parser().parse_args([*argv, "--load", "x", "--num-kv-components", "1",
                                          "--data-path", "d"])
        assert args.quiet == ("--quiet" in argv)


def test_a_full_disk_is_one_line_naming_the_output_and_leaves_nothing(checkpoints, tmp_path,
                                                                      capsys, tool_logging):
    # import-hf ended in a 33-line traceback (torch.save's short write: "unexpected pos N vs
    # M"), export-hf in "[Errno 28] No space left on device" naming no output. The disk fills
    # in the middle of the weights (a file-size limit: EFBIG, as a full disk gives ENOSPC).
    from tests._limits import file_size_limit

    hf_dir, source = checkpoints.hf("qwen3")[0], checkpoints.imported("qwen3")
    meg, out = str(tmp_path / "meg"), str(tmp_path / "hf")
    with file_size_limit(32 * 1024):
        imported = main(["--quiet", "import-hf", "--hf-dir", hf_dir, "--save", meg])
        exported = main(["--quiet", "export-hf", "--load", source, "--save", out])
    assert (imported, exported) == (1, 1)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"mea-convert: error: {path}: file size limit reached (ulimit -f); nothing "
                     "written (the partial output was removed)" for path in (meg, out)]
    assert os.listdir(tmp_path) == []
