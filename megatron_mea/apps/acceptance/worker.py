"""The training worker: one clean subprocess that runs the acceptance's training runs in turn.

Each run goes through mea-pretrain's own argument parser and `Trainer` (model, optimizer,
schedule, data), stepped here so that every step is timed and a run stops after its seconds.
"""

import gc
import json
import logging
import time
from typing import List

logger = logging.getLogger(__name__)


def train_worker(spec_path: str) -> int:
    """Run the training runs of `spec_path` (JSON: runs, seconds, out) one after the other.

    The raw record of every run (or its error) is rewritten to `out` after each run, so a
    worker killed by its timeout still leaves the runs it finished.

    Returns:
        0 (a failed run is recorded, not raised).
    """
    from megatron_mea.cpu import megatron_on_cpu

    with open(spec_path, encoding="utf-8") as handle:
        spec = json.load(handle)
    results = {}
    with megatron_on_cpu():
        for run in spec["runs"]:
            logger.info("training %s: %s", run["name"], " ".join(run["argv"]))
            try:
                results[run["name"]] = train_one(run["argv"], run.get("seconds", spec["seconds"]))
            except Exception as exc:  # noqa: BLE001 -- report it, run the next variant
                logger.exception("training %s failed", run["name"])
                results[run["name"]] = {"error": f"{type(exc).__name__}: {exc}"}
                del exc
                _release_memory()  # the failed run's model and optimizer, before the next one
            with open(spec["out"], "w", encoding="utf-8") as handle:
                json.dump(results, handle, indent=1)
    return 0


def _release_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def train_one(argv: List[str], seconds: float) -> dict:
    """Build mea-pretrain's `Trainer` for `argv` and step it until its iterations or `seconds`.

    Returns:
        The raw record: per-step losses and seconds, skipped steps, the model's shape (for the
        FLOP count), NVML telemetry, and on a GPU the peak memory.
    """
    import torch
    from megatron.core import parallel_state

    from megatron_mea.apps.training.arguments import parse_run
    from megatron_mea.apps.training.loop import Trainer

    on_gpu = torch.cuda.is_available()
    args, config = parse_run(argv)
    steps, telemetry = [], {}
    try:
        built_at = time.perf_counter()
        trainer = Trainer(args, config)
        build_s = time.perf_counter() - built_at
        if on_gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        deadline = time.perf_counter() + seconds
        while trainer.iteration < args.train_iters:
            start = time.perf_counter()
            scalars = trainer.train_step()  # ends with .item() calls: the step is complete
            if on_gpu:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            trainer.iteration += 1
            steps.append({"loss": scalars["lm loss"], "grad_norm": scalars["grad norm"],
                          "skipped": scalars["skipped"], "seconds": elapsed})
            if trainer.iteration == 1:
                telemetry = trainer.telemetry.read()
            if time.perf_counter() > deadline:
                break
        telemetry = trainer.telemetry.read() or telemetry
    finally:
        parallel_state.destroy_model_parallel()
    args = trainer.args  # the run's settings: the parsed arguments with the vocabulary resolved
    result = {
        "argv": argv,
        "build_s": build_s,
        "steps": len(steps),
        "iters_planned": args.train_iters,
        "tokens_per_step": args.global_batch_size * args.seq_length,
        "losses": [step["loss"] for step in steps],
        "step_seconds": [step["seconds"] for step in steps],
        "skipped_steps": sum(step["skipped"] for step in steps),
        "nvml_last": telemetry,
        "shape": {
            "num_layers": args.num_layers, "hidden_size": args.hidden_size,
            "num_attention_heads": args.num_attention_heads,
            "num_query_groups": args.num_query_groups or args.num_attention_heads,
            "kv_channels": args.kv_channels, "ffn_hidden_size": args.ffn_hidden_size,
            "seq_length": args.seq_length, "swiglu": args.swiglu,
            "vocab_size": args.padded_vocab_size,
        },
        "transformer_impl": args.transformer_impl,
        "core_attention": getattr(args, "core_attention", "megatron"),
        "bf16": args.bf16,
    }
    if on_gpu:
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    del trainer
    _release_memory()
    return result
