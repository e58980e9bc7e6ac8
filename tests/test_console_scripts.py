"""Every tool is a console script: each `[project.scripts]` entry of pyproject.toml resolves to a
callable in `megatron_mea.cli`, every CLI module has an entry, each installed script answers
`--help` with exit status 0 and nothing on stderr (no Megatron-Core warnings), each runs as
`python -m megatron_mea.cli.<name>`, and nothing under tools/ edits `sys.path`."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

# The console-script entry points: application code, the same on every Megatron-Core release;
# tested with one.
pytestmark = [pytest.mark.slow, pytest.mark.one_release("0.16")]

ROOT = Path(__file__).resolve().parents[1]
with open(ROOT / "pyproject.toml", "rb") as _handle:
    SCRIPTS = tomllib.load(_handle)["project"]["scripts"]
# pip installs the scripts next to the interpreter of the environment running the tests.
BIN = Path(sys.executable).parent
CLI_MODULES = sorted(p.stem for p in (ROOT / "megatron_mea" / "cli").glob("*.py")
                     if not p.stem.startswith("_"))


def _target(name):
    module, _, attr = SCRIPTS[name].partition(":")
    return module, attr


def test_every_cli_module_has_a_console_script():
    modules = {_target(name)[0] for name in SCRIPTS}
    assert modules == {f"megatron_mea.cli.{stem}" for stem in CLI_MODULES}
    assert all(name.startswith("mea-") for name in SCRIPTS)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_entry_point_is_an_importable_callable_also_run_as_a_module(name):
    module_name, attr = _target(name)
    module = importlib.import_module(module_name)
    assert callable(getattr(module, attr)), SCRIPTS[name]
    # `python -m megatron_mea.cli.<name>` runs the same main.
    assert 'if __name__ == "__main__":\n    sys.exit(main())' in Path(module.__file__).read_text()


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_installed_script_prints_help_without_warnings(name):
    script = BIN / name
    if not script.exists():
        pytest.fail(f"{script} is not installed: run `{sys.executable} -m pip install --no-deps "
                    f"-e {ROOT}` after changing [project.scripts]")
    run = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "usage:" in run.stdout
    assert run.stderr == "", f"{name} --help wrote to stderr:\n{run.stderr[-3000:]}"


def test_python_dash_m_runs_a_tool():
    run = subprocess.run([sys.executable, "-m", "megatron_mea.cli.convert", "--help"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0 and run.stdout.startswith("usage: mea-convert"), run.stderr[-3000:]


def test_nothing_under_tools_edits_sys_path():
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "tools").rglob("*.py")
                 if "sys.path" in p.read_text(encoding="utf-8")]
    assert offenders == [], "tools must not edit sys.path (install the package instead)"
