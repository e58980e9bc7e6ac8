"""Each patch series in patches/<tag>/ applies exactly to the Megatron-LM files it edits at its tag.

The targets are vendored under megatron_lm_targets/<tag>/ (see its README), so the check runs in CI
with no checkout. A full checkout named by MEGATRON_LM_DIR is checked too when given.
"""

import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from megatron_mea.integrations.mlm_flags import MEGATRON_LM_TAGS, tag_for_core_version

REPO = Path(__file__).resolve().parents[2]
PATCHES = REPO / "patches"
TARGETS = Path(__file__).resolve().parent / "megatron_lm_targets"
TAGS = sorted(MEGATRON_LM_TAGS)
MEGATRON_LM_DIR = os.environ.get("MEGATRON_LM_DIR")
HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def series(tag):
    return sorted((PATCHES / tag).glob("*.patch"))


def touched_files(patch):
    """Paths a patch edits (its `+++ b/<path>` lines)."""
    return [line[6:] for line in patch.read_text().splitlines() if line.startswith("+++ b/")]


def hunks(patch):
    """`(path, first old line, old lines)` for every hunk of a unified diff."""
    result, path = [], None
    lines = iter(patch.read_text().splitlines())
    for line in lines:
        if line.startswith("+++ b/"):
            path = line[6:]
        match = HUNK.match(line)
        if not match:
            continue
        old_left = int(match.group(2) or 1)
        new_left = int(match.group(4) or 1)
        old = []
        while old_left or new_left:  # the header's counts say where the hunk ends
            body = next(lines)
            kind, text = body[:1] or " ", body[1:]
            if kind in (" ", "-"):
                old.append(text)
                old_left -= 1
            if kind in (" ", "+"):
                new_left -= 1
        result.append((path, int(match.group(1)), old))
    return result


def git_blob_id(path):
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def git_apply_check(tree, tag):
    # A fresh repository at the tree's root: inside another repository's work tree, git apply
    # resolves paths against that root and skips the patch instead of failing.
    if not (tree / ".git").exists():
        subprocess.run(["git", "init", "-q"], cwd=tree, check=True)
    return subprocess.run(["git", "apply", "--check", "-v", *map(str, series(tag))],
                          cwd=tree, capture_output=True, text=True)


def test_every_tag_has_a_numbered_documented_series():
    readme = (PATCHES / "README.md").read_text()
    assert sorted(p.name for p in PATCHES.iterdir() if p.is_dir()) == TAGS
    assert not list(PATCHES.glob("*.patch")), "patches belong in patches/<tag>/"
    for tag in TAGS:
        names = [p.name for p in series(tag)]
        assert [n[:4] for n in names] == [f"{i:04d}" for i in range(1, len(names) + 1)], tag
        assert MEGATRON_LM_TAGS[tag] in readme, f"README does not pin {tag}'s commit"
        for name in names:
            assert f"{tag}/{name}" in readme, f"{tag}/{name} is not documented in README"


@pytest.mark.parametrize("tag", TAGS)
def test_vendored_files_are_the_tag_files_as_listed(tag):
    manifest = (TARGETS / "README.md").read_text()
    section = manifest.split(f"## {tag}\n")[1].split("\n## ")[0]
    assert MEGATRON_LM_TAGS[tag] in section
    listed = dict(re.findall(r"^\| `([^`]+)` \| `([0-9a-f]{40})` \|$", section, re.M))
    vendored = sorted(str(p.relative_to(TARGETS / tag)) for p in (TARGETS / tag).rglob("*")
                      if p.is_file())
    patched = {path for patch in series(tag) for path in touched_files(patch)}
    assert vendored == sorted(listed)
    assert patched <= set(vendored), f"{tag}: patched files not vendored: {patched - set(vendored)}"
    for path, blob in listed.items():
        assert git_blob_id(TARGETS / tag / path) == blob, f"{tag}/{path} differs from the tag"


@pytest.mark.parametrize("tag", TAGS)
def test_series_applies_without_offset_or_fuzz(tag):
    # Each hunk's old lines are exactly where its header says. This holds for a whole series only
    # if no two patches edit one file (a later patch would see the earlier one's result).
    paths = [path for patch in series(tag) for path in touched_files(patch)]
    assert len(paths) == len(set(paths)), f"{tag}: two patches edit one file"
    for patch in series(tag):
        for path, start, old in hunks(patch):
            lines = (TARGETS / tag / path).read_text().splitlines()
            assert lines[start - 1:start - 1 + len(old)] == old, f"{patch.name}: {path}:{start}"


@needs_git
@pytest.mark.parametrize("tag", TAGS)
def test_git_apply_check_on_the_vendored_targets(tag, tmp_path):
    tree = tmp_path / "Megatron-LM"
    shutil.copytree(TARGETS / tag, tree)
    result = git_apply_check(tree, tag)
    assert result.returncode == 0, result.stderr
    assert "Skipped" not in result.stderr, result.stderr


def checkout_tag(root):
    """The vendored tag matching the megatron-core version a Megatron-LM checkout declares."""
    text = (Path(root) / "megatron" / "core" / "package_info.py").read_text()
    parts = [re.search(rf"^{key} = (\d+)", text, re.M).group(1) for key in ("MAJOR", "MINOR")]
    return tag_for_core_version(".".join(parts))


@pytest.mark.skipif(not MEGATRON_LM_DIR,
                    reason="MEGATRON_LM_DIR is unset: no extra full Megatron-LM checkout to check")
@needs_git
def test_series_applies_to_the_megatron_lm_checkout(tmp_path):
    # A copy, so that the git init and the check never touch the user's checkout.
    tree = tmp_path / "Megatron-LM"
    tag = checkout_tag(MEGATRON_LM_DIR)
    paths = {path for patch in series(tag) for path in touched_files(patch)}
    for path in paths:
        (tree / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(MEGATRON_LM_DIR) / path, tree / path)
    result = git_apply_check(tree, tag)
    assert result.returncode == 0, f"{tag} series on {MEGATRON_LM_DIR}: {result.stderr}"
