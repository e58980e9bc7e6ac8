"""One convention for every tool's refusals: one line, `mea-<tool>: error: ...`, exit status 2,
no usage dump (argparse printed 95 lines of usage first, 578 for mea-model-size), an invalid
`mea-dry-run` launch included; `--help` of `mea-dry-run` and `mea-model-size` shows the tool's
own flags, Megatron-LM's behind `--help-all`, after them."""

import importlib
from pathlib import Path

import pytest

# The tools' refusals: application code, the same on every Megatron-Core release; tested with
# one.
pytestmark = pytest.mark.one_release("0.16")

ROOT = Path(__file__).resolve().parents[1]
CLI_MODULES = sorted(p.stem for p in (ROOT / "megatron_mea" / "cli").glob("*.py")
                     if not p.stem.startswith("_"))


def _tool(module: str) -> str:
    return "mea-" + {"evaluate": "eval"}.get(module, module).replace("_", "-")


@pytest.mark.parametrize("module", CLI_MODULES)
def test_a_flag_typo_is_one_line_and_exit_2(module, capsys):
    main = importlib.import_module(f"megatron_mea.cli.{module}").main
    with pytest.raises(SystemExit) as exc:
        main(["--no-such-flag"])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{_tool(module)}: error: "), err


def test_dry_run_help_is_its_own_and_megatrons_flags_are_behind_help_all(capsys):
    from megatron_mea.cli.dry_run import main

    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    own = capsys.readouterr().out
    assert own.startswith("usage: mea-dry-run [--world-size N] [...] -- <Megatron-LM flags>")
    assert "--help-all" in own and "--num-layers" not in own
    assert main(["--help-all"]) == 0
    assert "--num-layers" in capsys.readouterr().out


@pytest.mark.parametrize("extra, world_size, message", [
    (["--pipeline-model-parallel-size", "3"], "3",
     "--num-layers (4) must be divisible by --pipeline-model-parallel-size (3)"),
    # Megatron-LM divides by it while filling defaults: a ZeroDivisionError traceback before
    (["--tensor-model-parallel-size", "0"], "1",
     "--tensor-model-parallel-size must be at least 1, got 0"),
    # Megatron-LM's validate_args asserts these; the dry run called them valid before.
    (["--num-attention-heads", "7"], "1",
     "--hidden-size (256) must be divisible by --num-attention-heads (7) (or give --kv-channels)"),
    (["--group-query-attention", "--num-query-groups", "3"], "1",
     "--num-attention-heads (8) must be divisible by --num-query-groups (3)"),
    (["--pipeline-model-parallel-size", "2", "--account-for-embedding-in-pipeline-split"], "2",
     "--num-layers (4, 5 with the embedding/loss counted) must be divisible by "
     "--pipeline-model-parallel-size (2)"),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"], "2",
     "--num-layers-per-virtual-pipeline-stage (3) must divide the 2 layers of each pipeline "
     "stage"),
])
def test_dry_run_an_invalid_launch_is_a_refusal_one_line_and_exit_2(extra, world_size, message,
                                                                     capsys):
    from megatron_mea.cli.dry_run import main

    flags = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
             "--seq-length", "512", "--max-position-embeddings", "512", "--micro-batch-size", "1",
             "--train-iters", "10", "--mock-data"] + extra
    with pytest.raises(SystemExit) as exc:
        main(["--world-size", world_size, "--"] + flags)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"mea-dry-run: error: {message}\n"


def test_model_size_help_shows_its_own_flags_first_megatrons_behind_help_all(capsys):
    from megatron_mea.cli.model_size import main

    own_flags = ("--help-all", "--kv-bytes-per-element", "--default-vocab-size", "--json")
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    help_text = capsys.readouterr().out
    assert help_text.startswith("usage: mea-model-size [-h] [--help-all]")
    assert all(f"  {flag}" in help_text for flag in own_flags)
    assert "  --num-layers" not in help_text and "  --attention-variant" not in help_text
    with pytest.raises(SystemExit) as exc:
        main(["--help-all"])
    assert exc.value.code == 0
    help_all = capsys.readouterr().out
    assert help_all.startswith(help_text)  # the tool's own help first, then the passthrough
    last_own = max(help_all.index(f"  {flag}") for flag in own_flags)
    assert last_own < help_all.index("  --num-layers") < help_all.index("  --attention-variant")


def test_model_size_refuses_a_model_training_would_refuse(capsys):
    # It sized this model before: the config's checks did not run.
    from megatron_mea.cli.model_size import main

    with pytest.raises(SystemExit) as exc:
        main(["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4",
              "--vocab-size", "1000", "--attention-variant", "mea",
              "--mea-num-kv-components", "3"])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(
        "mea-model-size: error: mea_num_kv_components (3) must divide num_attention_heads (4)")
    assert len(err.splitlines()) == 1
