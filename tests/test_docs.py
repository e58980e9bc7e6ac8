"""The docs' examples run as written: the README's "Use" snippet, `mea-preprocess` then the paths
the pretraining and sweep examples read (docs/pretraining.md, docs/studies.md), and the run
directories the demo writes that the eval and generate examples load (docs/inference.md). A doc
example that cannot run fails here; every `mea-*` command line of the README and docs/*.md is
parsed by its tool in tests/test_doc_commands.py. The README is a landing page: its command table
names every console script with a link to a page that exists, and docs/README.md lists every page."""

import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.test_doc_commands import DOCS, shell_commands

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _env():
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, PYTHONWARNINGS="ignore")


def _doc_commands():
    """Every command of the shell blocks of README.md and docs/*.md, continuation lines joined."""
    return [command for path in DOCS for _, command in shell_commands(path)]


def test_the_use_snippet_runs(tmp_path):
    snippet = re.search(r"## Use\n\n```python\n(.*?)```", README, re.S).group(1)
    run = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


def test_preprocess_writes_what_the_training_examples_read(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.jsonl").write_text('{"text": "one document"}\n')
    (tmp_path / "notes.txt").write_text("another document\n")
    (preprocess,) = [c for c in _doc_commands()
                     if c.startswith("mea-preprocess") and "ByteLevelTokenizer" in c]
    command = preprocess.replace("mea-preprocess", shlex.quote(sys.executable)
                                 + " -m megatron_mea.cli.preprocess", 1)
    run = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    reads = [shlex.split(c, comments=True) for c in _doc_commands() if "--data-path data/" in c]
    data_paths = {tokens[tokens.index("--data-path") + 1] for tokens in reads}
    assert data_paths, "no example reads the preprocessed data"
    for prefix in data_paths:
        assert (tmp_path / f"{prefix}.bin").is_file() and (tmp_path / f"{prefix}.idx").is_file(), (
            f"--data-path {prefix}: mea-preprocess as the docs run it does not write it")


def test_the_eval_and_generate_examples_load_the_demos_run_directories():
    demo = (ROOT / "megatron_mea" / "cli" / "demo.py").read_text(encoding="utf-8")
    out = re.search(r'"--out", default="([^"]+)"', demo).group(1)
    pipeline = (ROOT / "megatron_mea" / "apps" / "demo" / "pipeline.py").read_text(
        encoding="utf-8")
    assert 'os.path.join(args.out, "runs", name)' in pipeline  # where the demo writes a variant
    # The examples on the demo's checkpoints (others name placeholders: CKPT, /ckpt/kha).
    docs = "\n".join(path.read_text(encoding="utf-8") for path in DOCS)
    loads = [load for load in re.findall(r"mea-(?:eval|generate) --load (\S+)", docs)
             if load.startswith(out)]
    assert len(loads) >= 3
    for load in loads:
        assert os.path.dirname(load) == os.path.join(out, "runs"), load  # demo: <out>/runs/<name>


def test_the_readme_command_table_names_every_console_script_and_its_page():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"][
        "scripts"]
    table = re.search(r"## Commands\n(.*?)\n## ", README, re.S).group(1)
    rows = {row.group(1): row.group(2) for row in re.finditer(
        r"^\| `([^`]+)` \|.*\]\(([^)]+)\) \|$", table, re.M)}
    assert set(scripts) <= set(rows), f"not in the README's table: {set(scripts) - set(rows)}"
    for command, page in rows.items():
        assert (ROOT / page).is_file(), f"README: {command} links to {page}, which does not exist"


def test_the_docs_index_lists_every_page():
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    pages = {path.name for path in (ROOT / "docs").glob("*.md")} - {"README.md"}
    listed = set(re.findall(r"^\| \[([\w.-]+\.md)\]\(", index, re.M))
    assert pages <= listed, f"docs/README.md does not list {sorted(pages - listed)}"
