"""Every command line of a `mea-*` tool in the fenced shell blocks (```bash, ```sh, ```shell,
```console) of README.md and docs/*.md is one its tool takes.

Each is parsed by that tool's own `main`, stopped once its parser has parsed (every flag exists,
is written in full and has its value of its type, every sub-command exists; no file is read and
nothing starts); `mea-model-size` and `mea-dry-run` commands, under a second each, run to the end. A
command is a tool's when it starts with `mea-<tool>` or `python -m megatron_mea.cli.<module>`
(after any `VAR=value`), or is `torchrun ... --no-python mea-<tool> ...` (the torchrun flags
are not checked). Not checked here: other programs' commands (`make`, `bash scripts/...`, `pip`,
`vllm`, Megatron-LM's `pretrain_gpt.py` under torchrun); `python -m megatron_mea.cpu ...` and
docs/cpu.md's blocks (tests/integrations/test_megatron_lm_cpu.py); indented blocks
(docs/megatron-lm.md's `DRY_RUN=1 bash examples/...`: tests/integrations/test_examples_dry_run.py
runs the scripts); tool commands written inside prose. tests/test_docs.py runs the preprocessing
example of docs/pretraining.md and checks the paths the other examples read.
"""

import argparse
import importlib
import re
import shlex
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
# The console scripts: `mea-<tool>` -> "megatron_mea.cli.<module>:main".
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
# The tools whose doc commands are cheap enough to run to the end.
RUN_FULLY = {"mea-model-size", "mea-dry-run"}


def shell_commands(path: Path):
    """`(where, command)` for each command line of the fenced shell blocks of `path`, its
    continuation lines joined (comments kept: `shlex.split(command, comments=True)` drops them).
    `where` is `file:line`."""
    text = path.read_text(encoding="utf-8")
    fence = re.compile(r"^( *)```(?:bash|sh|shell|console)\n(.*?)^\1```", re.M | re.S)
    for block in fence.finditer(text):
        first_line = text.count("\n", 0, block.start(2)) + 1
        lines = block.group(2).splitlines()
        i = 0
        while i < len(lines):
            start, command = i, lines[i]
            while command.endswith("\\") and i + 1 < len(lines):
                i += 1
                command = command[:-1] + " " + lines[i].strip()
            i += 1
            if command.strip() and not command.strip().startswith("#"):
                yield f"{path.relative_to(ROOT)}:{first_line + start}", command.strip()


def _tool_command(tokens: list):
    """`(console script, its arguments)` when the command runs a `mea-*` tool, else None."""
    while tokens and re.match(r"[A-Za-z_][A-Za-z0-9_]*=", tokens[0]):
        tokens = tokens[1:]  # VAR=value before the command
    if tokens[:1] == ["torchrun"]:
        tool = next((i for i, token in enumerate(tokens) if token.startswith("mea-")), None)
        if tool is None:
            return None  # torchrun on a Python script (Megatron-LM's, the CPU runner)
        assert "--no-python" in tokens[:tool], f"torchrun runs {tokens[tool]} without --no-python"
        tokens = tokens[tool:]
    if tokens[:2] in (["python", "-m"], ["python3", "-m"]) and tokens[2:3] and (
            tokens[2].startswith("megatron_mea.cli.")):
        target = tokens[2] + ":main"
        scripts = [name for name, entry in SCRIPTS.items() if entry == target]
        return (scripts[0] if scripts else target), tokens[3:]
    if tokens and tokens[0].startswith("mea-"):
        return tokens[0], tokens[1:]
    return None


DOC_COMMANDS = [(where, *_tool_command(shlex.split(command, comments=True)))
                for path in DOCS for where, command in shell_commands(path)
                if _tool_command(shlex.split(command, comments=True))]


class _Parsed(Exception):
    """Raised by the patched `parse_args` once the tool's parser has taken its arguments."""


def test_the_docs_show_tool_commands():
    # A guard on the extraction itself: the README and docs/ show 30 and more.
    assert len(DOC_COMMANDS) >= 30, DOC_COMMANDS
    assert {"mea-pretrain", "mea-convert", "mea-model-size", "mea-dry-run",
            "mea-gpu-acceptance"} <= {script for _, script, _ in DOC_COMMANDS}


@pytest.mark.parametrize("where,script,argv", DOC_COMMANDS,
                         ids=[f"{where}:{script}" for where, script, _ in DOC_COMMANDS])
def test_a_doc_command_is_taken_by_its_tool(where, script, argv, monkeypatch, capsys):
    assert script in SCRIPTS, f"{where}: no console script {script}"
    module, function = SCRIPTS[script].split(":")
    main = getattr(importlib.import_module(module), function)
    # No abbreviated flags: argparse would take `--save-int` for `--save-interval`, a doc
    # command that breaks when a second flag starts the same way.
    monkeypatch.setattr(argparse.ArgumentParser, "_get_option_tuples", lambda parser, arg: [])
    if script in RUN_FULLY:
        try:
            status = main(argv)
        except SystemExit as exc:
            status = exc.code
        assert status == 0, f"{where}: {script} exits with {status}: {capsys.readouterr().err}"
        return
    parse_args = argparse.ArgumentParser.parse_args

    def parse_then_stop(parser, args=None, namespace=None):
        raise _Parsed(parse_args(parser, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    try:
        main(argv)
    except _Parsed:
        return
    except SystemExit as exc:
        pytest.fail(f"{where}: {script} refuses it (exit {exc.code}): "
                    f"{capsys.readouterr().err.strip()}", pytrace=False)
    pytest.fail(f"{where}: {script} ran without parsing its arguments", pytrace=False)
