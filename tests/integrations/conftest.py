"""Fixtures for Megatron-LM's own training loop on CPU (see megatron_lm_cpu.py)."""

import shutil

import pytest

from tests.integrations.megatron_lm_cpu import MEA, TINY, TP2_SP, installed_tag, patched_tree, train


@pytest.fixture(scope="session")
def megatron_lm_tree(tmp_path_factory):
    """The vendored Megatron-LM subset at the installed megatron-core's tag, patches applied."""
    if shutil.which("git") is None:
        pytest.fail("git is needed to apply patches/<tag>/ to the vendored Megatron-LM tree")
    tag = installed_tag()
    return patched_tree(tag, tmp_path_factory.mktemp("megatron_lm") / tag)


@pytest.fixture(scope="session")
def mea_tp2_checkpoint(megatron_lm_tree, tmp_path_factory):
    """A real Megatron-LM checkpoint (torch_dist) of the tiny MEA model (virtual heads, one MoE
    layer) trained by the patched ``pretrain_gpt.py`` at TP=2 + SP for 4 iterations, saved at
    iterations 2 and 4 (the tracker file names 4).

    Returns:
        (checkpoint folder, the flags it was trained with, the `Run` with its losses).
    """
    checkpoint = tmp_path_factory.mktemp("mea_tp2") / "checkpoint"
    args = [*TINY, *MEA, *TP2_SP]
    run = train(megatron_lm_tree, "pretrain_gpt.py",
                [*args, "--train-iters", "4", "--save", str(checkpoint), "--save-interval", "2"],
                iterations=[1, 2, 3, 4], nproc=2)
    return checkpoint, args, run
