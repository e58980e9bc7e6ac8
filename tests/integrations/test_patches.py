"""The patch series in patches/ applies to the Megatron-LM checkout named by MEGATRON_LM_DIR."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

PATCHES = sorted((Path(__file__).resolve().parents[2] / "patches").glob("*.patch"))
MEGATRON_LM_DIR = os.environ.get("MEGATRON_LM_DIR")


def test_series_is_numbered_and_documented():
    assert [p.name[:4] for p in PATCHES] == ["0001", "0002"]
    readme = (PATCHES[0].parent / "README.md").read_text()
    for patch in PATCHES:
        assert patch.name in readme


@pytest.mark.skipif(not MEGATRON_LM_DIR,
                    reason="MEGATRON_LM_DIR is unset: no Megatron-LM core_v0.16.1 checkout to "
                           "apply the patches to")
@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_patch_series_applies_to_megatron_lm_checkout():
    result = subprocess.run(["git", "apply", "--check", "-v", *map(str, PATCHES)],
                            cwd=MEGATRON_LM_DIR, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
