"""tools/: Megatron-LM-style scripts where Megatron users look for them, each a thin caller of a
console script's `main` (it parses nothing of its own and holds no logic), run as
`python tools/...` from a checkout with the package installed, and not part of the package."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
# Each script, the console script whose main it calls.
TOOLS = {
    "tools/preprocess_data.py": "mea-preprocess",
    "tools/checkpoint/convert.py": "mea-convert",
}


def _run(script, *args, cwd):
    return subprocess.run([sys.executable, str(ROOT / script), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_every_script_under_tools_is_listed():
    found = {str(p.relative_to(ROOT)) for p in (ROOT / "tools").rglob("*.py")}
    assert found == set(TOOLS)


@pytest.mark.parametrize("script", sorted(TOOLS))
def test_a_tool_only_calls_its_console_scripts_main(script):
    with open(ROOT / "pyproject.toml", "rb") as handle:
        entry = tomllib.load(handle)["project"]["scripts"][TOOLS[script]]
    module, _, function = entry.partition(":")
    tree = ast.parse((ROOT / script).read_text(encoding="utf-8"))
    imports = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert [(node.module, [a.name for a in node.names]) for node in imports
            if isinstance(node, ast.ImportFrom)] == [(module, [function])]
    assert [node.name for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef))] == [], "no logic of its own"


@pytest.mark.parametrize("script", sorted(TOOLS))
def test_a_tool_answers_help_as_its_console_script(script, tmp_path):
    run = _run(script, "--help", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith(f"usage: {TOOLS[script]}"), run.stdout[:300]


def test_preprocess_data_writes_a_dataset(tmp_path):
    (tmp_path / "corpus.jsonl").write_text('{"text": "one document"}\n{"text": "another"}\n')
    run = _run("tools/preprocess_data.py", "--input", "corpus.jsonl", "--output-prefix",
               "data/corpus", "--tokenizer-type", "ByteLevelTokenizer", "--append-eod",
               "--no-progress", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "documents written: 2" in run.stdout
    assert (tmp_path / "data/corpus.bin").is_file() and (tmp_path / "data/corpus.idx").is_file()


def test_convert_refuses_a_folder_without_a_model_in_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    run = _run("tools/checkpoint/convert.py", "import-hf", "--hf-dir", "empty", "--save", "out",
               cwd=tmp_path)
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.stderr.splitlines()[-1].startswith("mea-convert: error: empty/config.json")
    assert not (tmp_path / "out").exists()


def test_tools_are_not_part_of_the_installed_package():
    with open(ROOT / "pyproject.toml", "rb") as handle:
        found = tomllib.load(handle)["tool"]["setuptools"]["packages"]["find"]
    assert found["include"] == ["megatron_mea*"]
    assert not list((ROOT / "tools").rglob("__init__.py"))
