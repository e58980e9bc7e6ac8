"""Downstream evaluation with EleutherAI's lm-evaluation-harness on a Hugging Face export.

`evaluate_checkpoint` exports a Megatron checkpoint (`checkpoint.export_hf_checkpoint`: a stock
architecture where the variant folds, our modeling code otherwise), gives the export a tokenizer
when it has none, and runs the harness's `simple_evaluate` with its `hf` model on it. Every task
of the harness works (PIQA, HellaSwag, ARC, WinoGrande, MMLU...), and local YAML tasks through
`include_path`. `mea-eval` is the command line over it.

The harness (`lm-eval`, PyPI) is an optional dependency: `pip install megatron_mea[eval]`.
"""

import json
import logging
import os
import subprocess
import tempfile
from contextlib import contextmanager
from typing import Optional, Sequence

from megatron_mea.checkpoint.hf.exporting import export_hf_checkpoint
from megatron_mea.checkpoint.hf.files import has_tokenizer
from megatron_mea.data.tokenizers import ByteLevelTokenizer

logger = logging.getLogger(__name__)

BYTE_LEVEL = "byte-level"
BYTE_LEVEL_VOCAB = ByteLevelTokenizer().vocab_size  # 256 bytes and <eod>


def _checkpoint_tokenizer_type(load_dir: str) -> Optional[str]:
    from megatron_mea.checkpoint.torch_dist.model_only import ModelDescription

    return getattr(ModelDescription.load(load_dir).args, "tokenizer_type", None)


def export_for_evaluation(load_dir: str, save_dir: str, tokenizer: Optional[str] = None,
                          format: str = "auto",  # noqa: A002 -- the CLI flag's name
                          iteration: Optional[int] = None) -> str:
    """Export `load_dir` to `save_dir` in fp32 with a tokenizer; returns the export's format.

    Args:
        tokenizer: `byte-level` (the package's byte tokenizer), an HF tokenizer directory, or
            None: the export's own tokenizer files, else `byte-level` for checkpoints trained
            with `ByteLevelTokenizer`.
        format: `auto`, `plain` or `native` (`export_hf_checkpoint`).
        iteration: the checkpoint to export. Default: the latest.
    """
    import torch

    from megatron_mea.cpu import megatron_on_cpu

    with megatron_on_cpu():  # the export builds the Megatron model (on `meta`) to read shapes
        written = export_hf_checkpoint(load_dir, save_dir, format=format, dtype=torch.float32,
                                       iteration=iteration)
    with open(os.path.join(save_dir, "config.json"), encoding="utf-8") as handle:
        vocab_size = json.load(handle)["vocab_size"]
    byte_level_fits = vocab_size >= BYTE_LEVEL_VOCAB
    if tokenizer is None and not has_tokenizer(save_dir):
        if _checkpoint_tokenizer_type(load_dir) != "ByteLevelTokenizer" or not byte_level_fits:
            raise ValueError(
                f"{load_dir}: the export has no tokenizer files and the model is not a byte-level "
                f"one (ByteLevelTokenizer, >= {BYTE_LEVEL_VOCAB} ids; vocab_size {vocab_size}); "
                "pass --tokenizer (an HF tokenizer directory)"
            )
        tokenizer = BYTE_LEVEL
    if tokenizer == BYTE_LEVEL:
        if not byte_level_fits:
            raise ValueError(
                f"--tokenizer byte-level needs a vocabulary of >= {BYTE_LEVEL_VOCAB} ids; "
                f"{load_dir} has {vocab_size}"
            )
        ByteLevelTokenizer().save_hf(save_dir)
    elif tokenizer is not None:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer).save_pretrained(save_dir)
    return written


def evaluate_checkpoint(
    load_dir: str,
    tasks: Sequence[str],
    *,
    iteration: Optional[int] = None,
    include_path: Optional[str] = None,
    tokenizer: Optional[str] = None,
    export_dir: Optional[str] = None,
    format: str = "auto",  # noqa: A002
    batch_size: int = 1,
    device: str = "cpu",
    limit: Optional[float] = None,
    num_fewshot: Optional[int] = None,
    log_samples: bool = False,
) -> dict:
    """Export the checkpoint and evaluate it with lm-evaluation-harness.

    Args:
        load_dir: Megatron checkpoint root, or one of its `iter_XXXXXXX` folders.
        iteration: the checkpoint to evaluate. Default: the latest.
        tasks: harness task names (or names of tasks under `include_path`).
        include_path: a directory of extra YAML tasks; their data file paths are relative to
            it.
        tokenizer: as `export_for_evaluation`.
        export_dir: keep the export there. Default: a temporary directory, removed after.
        format: export format.
        batch_size, device, limit, num_fewshot: the harness's settings.
        log_samples: keep every request's response in `results["samples"]`.

    Returns:
        The harness's results dict (`results[task]["acc,none"]`...).
    """
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError as exc:
        raise ImportError(
            "evaluation needs lm-evaluation-harness: pip install 'megatron_mea[eval]'"
        ) from exc

    with tempfile.TemporaryDirectory(prefix="mea-eval-") as scratch:
        directory = os.path.abspath(export_dir or os.path.join(scratch, "hf"))
        written = export_for_evaluation(load_dir, directory, tokenizer, format, iteration)
        logger.info("exported %s as a %s HF model to %s", load_dir, written, directory)
        include_path = include_path and os.path.abspath(include_path)
        started_in = os.getcwd()
        # The `datasets` loader resolves a task's relative data files against the working
        # directory: in the include path's folder, its tasks run from any directory.
        if include_path:
            os.chdir(include_path)
        try:
            with _git_hash_without_stderr():
                return lm_eval.simple_evaluate(
                    model="hf",
                    model_args=f"pretrained={directory},trust_remote_code=True,dtype=float32",
                    tasks=list(tasks),
                    task_manager=TaskManager(include_path=include_path),
                    batch_size=batch_size,
                    device=device,
                    limit=limit,
                    num_fewshot=num_fewshot,
                    log_samples=log_samples,
                )
        finally:
            os.chdir(started_in)


@contextmanager
def _git_hash_without_stderr():
    """The harness records the git commit of the working directory by running `git describe`
    with the terminal as git's stderr, so that outside a repository every evaluation prints
    `fatal: not a git repository`. For the duration of the block, the same look-up (the same
    fallback to the files of `.git`) with git's stderr dropped. Harness versions without that
    look-up are left as they are."""
    from lm_eval import evaluator

    original = getattr(evaluator, "get_git_commit_hash", None)
    if original is None:
        yield
        return
    from lm_eval.loggers.utils import get_commit_from_path

    def quiet():
        try:
            found = subprocess.check_output(["git", "describe", "--always"],
                                            stderr=subprocess.DEVNULL)
            return found.strip().decode()
        except (subprocess.CalledProcessError, FileNotFoundError):
            return get_commit_from_path(os.getcwd())

    evaluator.get_git_commit_hash = quiet
    try:
        yield
    finally:
        evaluator.get_git_commit_hash = original
