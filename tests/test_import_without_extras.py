"""`pip install .` without extras imports every module of the package.

One fresh interpreter imports every module under `megatron_mea` while it cannot see the
top-level packages that `[project.dependencies]` does not install: those of every distribution
installed here outside that closure (the extras' transformers, tqdm, matplotlib, lm_eval...,
pytest and hypothesis, which only the tests bring), and the extras' and CUDA-only packages by
name (vLLM, Transformer Engine, Apex...). Each finder of `sys.meta_path` is wrapped to look for
those everywhere but in the installed packages: `import x` raises ModuleNotFoundError and
`importlib.util.find_spec("x")` answers None, as when it is not installed, while a copy vendored
inside an allowed package (setuptools' more_itertools) stays visible. (A finder that raised from
`find_spec` would break the probes of `megatron_mea._optional`.)

A module that needs an extra imports it where the feature is used, through
`megatron_mea._optional.import_extra` (a one-line ImportError naming the extra). The exceptions
below are modules that exist to subclass or register with an optional host.
"""

import importlib.metadata
import json
import os
import pkgutil
import re
import subprocess
import sys
import tomllib

from packaging.requirements import Requirement

import megatron_mea

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The import names of the extras' packages (pyproject.toml) and of the CUDA-only ones, hidden
# whether or not this machine has them.
OPTIONAL_PACKAGES = ("tqdm", "tensorboard", "matplotlib", "pynvml", "transformer_engine", "apex",
                     "transformers", "safetensors", "lm_eval", "vllm", "six", "pytest",
                     "hypothesis")

# Modules that cannot make sense without an extra's package; each that does not import must
# raise an ImportError naming its extra (`pip install 'megatron_mea[...]'`).
NEED_THEIR_HOST = {
    # Subclasses of transformers' configs and causal LMs, carried into exports as remote code
    # (self-contained: no lazy door to megatron_mea._optional there), and the package that
    # registers them with transformers' Auto classes.
    "megatron_mea.integrations.transformers": "hf",
    "megatron_mea.integrations.transformers.configuration_megatron_mea": "hf",
    "megatron_mea.integrations.transformers.modeling_megatron_mea": "hf",
    # The vLLM plugin: vLLM's model classes, layers and attention backend (vLLM loads it
    # through its entry point, so vLLM is there whenever it is used).
    "megatron_mea.integrations.vllm": "vllm",
    "megatron_mea.integrations.vllm.attention": "vllm",
    "megatron_mea.integrations.vllm.models": "vllm",
    "megatron_mea.integrations.vllm.scaled_cache": "vllm",
    "megatron_mea.integrations.vllm.components_cpu": "vllm",
    "megatron_mea.integrations.vllm.paged_decode": "vllm",
    "megatron_mea.integrations.vllm.prefill": "vllm",
    "megatron_mea.integrations.vllm.triton_attention": "vllm",
    # The paged Triton kernel: Triton comes with CUDA builds of torch and with vLLM.
    "megatron_mea.ops.paged_attention": "vllm",
}

SCRIPT = r"""
import importlib, json, os, site, sys

hidden = set(json.loads(sys.argv[1]))
installed = {os.path.realpath(p) for p in [*site.getsitepackages(), site.getusersitepackages()]}


class Hiding:
    # One finder of sys.meta_path that looks for the packages `hidden` everywhere but in the
    # installed packages (a copy vendored inside another package, as setuptools' more_itertools,
    # stays visible).
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if "." not in name and name in hidden:
            path = [p for p in sys.path if os.path.realpath(p or ".") not in installed]
        return self.finder.find_spec(name, path, target)

    def invalidate_caches(self):
        getattr(self.finder, "invalidate_caches", lambda: None)()


sys.meta_path[:] = [Hiding(finder) for finder in sys.meta_path]
outcome = {}
for name in sys.argv[2:]:
    try:
        importlib.import_module(name)
        outcome[name] = "ok"
    except BaseException as exc:  # SystemExit too: a module that exits on import is a failure
        outcome[name] = f"{type(exc).__name__}: {exc}"
print(json.dumps(outcome))
"""


def _canonical(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def base_distributions() -> set:
    """The distributions `pip install .` installs: `[project.dependencies]` and, transitively,
    what they require (markers evaluated for this machine, no extras), as installed here."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as handle:
        pending = list(tomllib.load(handle)["project"]["dependencies"])
    found = set()
    while pending:
        requirement = Requirement(pending.pop())
        name = _canonical(requirement.name)
        if name in found or (requirement.marker and not requirement.marker.evaluate({"extra": ""})):
            continue
        try:
            requires = importlib.metadata.requires(requirement.name) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed here (a platform's own, e.g. CUDA wheels on a CPU machine)
        found.add(name)
        pending.extend(requires)
    return found


def hidden_top_levels() -> list:
    """The top-level packages an install without extras does not have: those of every
    distribution installed here outside `base_distributions()` (unless a base one shares the
    name), and the extras' and the CUDA-only packages, installed here or not."""
    base = base_distributions()
    installed = {top for top, owners in importlib.metadata.packages_distributions().items()
                 if not any(_canonical(owner) in base for owner in owners)}
    return sorted((installed | set(OPTIONAL_PACKAGES)) - {"megatron_mea"})


def test_the_base_install_keeps_its_packages_and_hides_the_extras():
    # A closure that found nothing, or the extras, would make the test below mean nothing.
    hidden = set(hidden_top_levels())
    assert not hidden & {"torch", "numpy", "yaml", "megatron", "packaging", "psutil"}, hidden
    assert set(OPTIONAL_PACKAGES) <= hidden


def package_modules(path=megatron_mea.__path__, prefix="megatron_mea.") -> list:
    """Every module of the package, found without importing any (`pkgutil.walk_packages`
    imports each package to look inside: one that needs an extra would hide its modules)."""
    names = []
    for info in pkgutil.iter_modules(path, prefix):
        names.append(info.name)
        if info.ispkg:
            names += package_modules([os.path.join(info.module_finder.path, info.name.rsplit(
                ".", 1)[1])], info.name + ".")
    return names


def test_every_module_imports_without_the_extras(tmp_path):
    modules = ["megatron_mea", *package_modules()]
    assert len(modules) > 100 and set(NEED_THEIR_HOST) <= set(modules)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(hidden_top_levels()), *modules],
        env=dict(env, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=600,
        cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.splitlines()[-1])
    failed = {name: what for name, what in outcome.items()
              if what != "ok" and name not in NEED_THEIR_HOST}
    assert not failed, "modules that do not import without the extras:\n" + "\n".join(
        f"  {name}: {what}" for name, what in sorted(failed.items()))
    unnamed = {name: outcome[name] for name, extra in NEED_THEIR_HOST.items()
               if outcome[name] != "ok"
               and f"pip install 'megatron_mea[{extra}]'" not in outcome[name]}
    assert not unnamed, unnamed
