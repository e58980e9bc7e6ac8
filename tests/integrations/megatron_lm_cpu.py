"""Megatron-LM's own training loop on CPU, for the tests: the vendored tree, patched, and runs of
its scripts through ``python -m megatron_mea.cpu`` under torchrun.

``patched_tree`` copies ``megatron_lm_targets/<tag>/`` (the part of Megatron-LM at ``tag`` that
``pretrain_gpt.py`` imports on top of the installed megatron-core) and applies
``patches/<tag>/``; ``train`` runs a script of that tree (or ``pretrain_gpt_mea.py``) and returns
the losses Megatron-LM logged. ``mea_tp2_checkpoint`` in ``conftest.py`` is a real Megatron-LM
checkpoint built this way, for any test that needs one.
"""

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence

REPO = Path(__file__).resolve().parents[2]
TARGETS = Path(__file__).resolve().parent / "megatron_lm_targets"
ENTRY = REPO / "examples" / "megatron_lm" / "pretrain_gpt_mea.py"
LOSS = re.compile(r"\biteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.]+E[+-]\d+) \|")

# A 2-layer GPT in fp32 with the local (non-TE) spec; Megatron's fused kernels off (CPU).
TINY = [
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
    "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "4",
    "--seq-length", "32", "--max-position-embeddings", "32",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
    "--disable-bias-linear", "--attention-dropout", "0", "--hidden-dropout", "0",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--seed", "1234",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255",
    "--transformer-impl", "local", "--use-cpu-initialization", "--distributed-backend", "gloo",
    "--no-gradient-accumulation-fusion", "--no-rope-fusion", "--no-persist-layer-norm",
    "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion",
    "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
    "--ckpt-format", "torch_dist",
]
# MEA with virtual heads (2 K/V components for 4 query groups) and one MoE layer (the second).
MOE = [
    "--num-experts", "4", "--moe-layer-freq", "[0,1]", "--moe-ffn-hidden-size", "64",
    "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
]
MEA_VARIANT = ["--attention-variant", "mea", "--mea-num-kv-components", "2"]
MEA = [*MEA_VARIANT, *MOE]
KHA = ["--attention-variant", "kha", "--kha-variant", "mlp", "--kha-targets", "v"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]


def installed_tag() -> str:
    from megatron_mea.integrations.mlm_flags import installed_tag as tag

    return tag()


def patched_tree(tag: str, destination: Path) -> Path:
    """The vendored Megatron-LM subset at `tag`, copied to `destination`, with the tag's patch
    series applied by ``git apply`` (as a user applies it to a checkout)."""
    shutil.copytree(TARGETS / tag, destination)
    subprocess.run(["git", "init", "-q"], cwd=destination, check=True)
    patches = sorted(str(p) for p in (REPO / "patches" / tag).glob("*.patch"))
    subprocess.run(["git", "apply", *patches], cwd=destination, check=True)
    return destination


@dataclass
class Run:
    """One finished run: the losses by iteration (as logged, 7 significant digits) and the log."""

    losses: Dict[int, str]
    log: str

    def loss_values(self) -> Dict[int, float]:
        return {iteration: float(loss) for iteration, loss in self.losses.items()}


def train(tree: Path, script: str, args: Sequence[str], iterations: Sequence[int],
          nproc: int = 1, timeout: int = 600) -> Run:
    """Run `script` (``pretrain_gpt.py`` of `tree`, or ``pretrain_gpt_mea.py``) with
    ``torchrun --standalone --nproc-per-node nproc -m megatron_mea.cpu``.

    Args:
        tree: a Megatron-LM tree (``patched_tree``); it goes first on ``PYTHONPATH``.
        script: ``"pretrain_gpt.py"`` (in `tree`) or ``"pretrain_gpt_mea.py"`` (the example).
        args: Megatron-LM flags.
        iterations: the iterations the run must log a loss for. (Megatron-LM exits with status 0
            on some failures, e.g. a checkpoint without RNG states.)
        nproc: torchrun's processes; 0: one plain `python -m megatron_mea.cpu` process.
    Raises:
        AssertionError: with the end of the log, if the run fails or logs other iterations.
    """
    path = ENTRY if script == ENTRY.name else tree / script
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(tree), str(REPO), *filter(None, [env.get("PYTHONPATH")])]),
        CUDA_DEVICE_MAX_CONNECTIONS="1",  # Megatron-LM's TP check (see megatron_mea/cpu/runner.py L6)
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
    )
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    if nproc == 0:  # one process, without torchrun (nor its rendezvous variables)
        launcher = []
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)
    command = [sys.executable, *launcher, "-m", "megatron_mea.cpu", str(path), *args]
    result = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True,
                            timeout=timeout)
    log = result.stdout + result.stderr
    assert result.returncode == 0, f"{script} {' '.join(args)} failed:\n{log[-6000:]}"
    losses = {int(i): loss for i, loss in LOSS.findall(log)}
    assert sorted(losses) == list(iterations), f"iterations {sorted(losses)}:\n{log[-6000:]}"
    return Run(losses=losses, log=log)


def set_latest_iteration(checkpoint: Path, iteration: int) -> None:
    """Point Megatron-LM's tracker file at `iteration`, so ``--load`` resumes from there."""
    (checkpoint / "latest_checkpointed_iteration.txt").write_text(str(iteration))


def logged_arg(run: Run, name: str) -> str:
    """The value of `name` in the arguments Megatron-LM prints at start-up."""
    match = re.search(rf"^  {name} \.+ (.*)$", run.log, re.M)
    assert match, f"{name} is not in the logged arguments"
    return match.group(1)


def checkpoint_tensors(checkpoint: Path, iteration: int, scratch: Path) -> Dict[str, object]:
    """Every tensor of a ``torch_dist`` checkpoint, unsharded (model and optimizer state)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = scratch / f"{checkpoint.name}_{iteration}.pt"
    dcp_to_torch_save(checkpoint / f"iter_{iteration:07d}", path)
    state = torch.load(path, weights_only=False)  # written just above by this test
    return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}


def resumed_losses_match(resumed: Run, uninterrupted: Run, rel: float = 0.0) -> bool:
    """Whether a run resumed at iteration i logged the losses of the uninterrupted run.

    Megatron-LM does not reset its loss accumulator after the first logged iteration of a run
    (``is_first_iteration`` in ``training_log``, ``megatron/training/training.py``), so with
    ``--log-interval 1`` a run's second logged loss is the mean of its first two: the resumed
    run logs l(i+1), then (l(i+1) + l(i+2)) / 2, while the uninterrupted run logs l(i+1), l(i+2).
    """
    import pytest

    first, second = sorted(resumed.losses)
    expected = uninterrupted.loss_values()
    expected = {first: expected[first], second: (expected[first] + expected[second]) / 2}
    # The logged values have 7 significant digits; the mean of two is computed from them.
    return resumed.loss_values() == pytest.approx(expected, rel=max(rel, 2e-7))


def saved_iterations(checkpoint: Path) -> List[int]:
    return sorted(int(p.name[5:]) for p in checkpoint.glob("iter_*"))
