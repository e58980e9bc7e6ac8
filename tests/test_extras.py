"""The library installs with its own dependencies only; the applications' packages come with
extras, and a missing one is named with its extra.

A fresh interpreter that does not see the extras' packages (the site-packages directories
mirrored without them) imports every module of the package: the library's import; a module of an
application or an integration that needs an extra either imports (it uses the package lazily)
or raises an ImportError naming the extra.
"""

import os
import pkgutil
import subprocess
import sys
import tomllib

import megatron_mea
from megatron_mea._optional import EXTRA_OF

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HIDDEN = ("tqdm", "tensorboard", "matplotlib", "pynvml", "nvidia_ml_py", "transformers",
          "safetensors", "lm_eval", "vllm", "six")
# Modules whose whole purpose is an extra's package (they raise, naming the extra): the Hugging
# Face models and conversions, the vLLM plugin.
APPLICATIONS = ("megatron_mea.apps", "megatron_mea.cli")
NEED_AN_EXTRA = ("megatron_mea.integrations.transformers", "megatron_mea.checkpoint.hf.",
                 "megatron_mea.integrations.vllm",
                 "megatron_mea.ops.paged_attention")  # Triton: CUDA torch builds and vLLM bring it

SCRIPT = """
import importlib, json, sys
outcome = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
        outcome[name] = "ok"
    except ImportError as exc:
        outcome[name] = str(exc)
print(json.dumps(outcome))
"""


def _site_without(hidden, farm):
    """Every site-packages directory of this interpreter mirrored under `farm` by symbolic
    links, less the distributions of `hidden` (their packages and metadata): to the
    interpreter started with those directories, they are not installed."""
    import re
    import site

    directories = []
    for index, directory in enumerate(site.getsitepackages()):
        if not os.path.isdir(directory):
            continue
        mirror = farm / f"site{index}"
        mirror.mkdir(parents=True)
        for entry in os.listdir(directory):
            top = re.split(r"[-.]", entry)[0].lower()
            if top in hidden or entry.endswith(".pth"):
                continue
            os.symlink(os.path.join(directory, entry), mirror / entry)
        directories.append(str(mirror))
    return directories


def _modules():
    names = []
    for info in pkgutil.walk_packages(megatron_mea.__path__, "megatron_mea."):
        names.append(info.name)
    return names


def test_every_module_imports_without_the_extras_or_names_its_extra(tmp_path):
    import json

    modules = _modules()
    # -S: no site-packages but the mirrors (and no .pth files: the package from the checkout).
    path = os.pathsep.join([ROOT, *_site_without(HIDDEN, tmp_path)])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-S", "-c", SCRIPT, *modules], env=dict(
        env, PYTHONPATH=path), capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.splitlines()[-1])
    assert len(outcome) == len(modules) > 100
    library = [name for name in outcome if not name.startswith(NEED_AN_EXTRA + APPLICATIONS)]
    assert not {name: outcome[name] for name in library if outcome[name] != "ok"}
    # The rest import, or say which extra they need.
    assert not {name: what for name, what in outcome.items()
                if what != "ok" and "pip install 'megatron_mea[" not in what}


def test_the_base_dependencies_are_the_librarys_and_every_extra_is_declared():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as handle:
        project = tomllib.load(handle)["project"]
    base = {dep.split(">")[0].split("=")[0].split("<")[0].strip()
            for dep in project["dependencies"]}
    # psutil: Megatron-Core's checkpoint writer calls it without declaring it (a save hangs).
    assert base == {"megatron-core", "numpy", "pyyaml", "packaging", "psutil"}, base
    extras = project["optional-dependencies"]
    for module, extra in EXTRA_OF.items():
        assert extra in extras, (module, extra)
    assert {"tqdm", "tensorboard", "matplotlib", "nvidia-ml-py"} <= set(extras["tools"])


def test_a_missing_extra_package_is_named_with_its_extra(monkeypatch):
    import pytest

    from megatron_mea import _optional

    monkeypatch.setitem(_optional.EXTRA_OF, "megatron_mea_no_such_package", "tools")
    with pytest.raises(ImportError, match=r"the progress bar needs megatron_mea_no_such_package "
                                          r"\(the `tools` extra\): pip install 'megatron_mea\[tools\]'"):
        _optional.import_extra("megatron_mea_no_such_package", "the progress bar")
    monkeypatch.setitem(_optional.EXTRA_OF, "json", "tools")
    assert _optional.import_extra("json", "x").dumps({}) == "{}"  # present: the module itself
