"""Sizes and time limits of an acceptance run: `GPU_PLAN`, or `SMOKE_PLAN` with --cpu-smoke."""

import dataclasses
from typing import List


@dataclasses.dataclass
class Plan:
    """Sizes and time limits of one acceptance run (`GPU_PLAN` or `SMOKE_PLAN`)."""

    mode: str
    test_timeout_s: int
    # training (mea-pretrain flags), shared by the three runs
    train_flags: List[str]
    train_seconds: float  # per run, after the model is built; the run stops at iters or here
    warmup_seconds: float  # an unreported baseline run first (one-time costs of the process)
    train_timeout_s: int  # the whole training worker
    # layer benchmark: (hidden, heads, groups) per shape, and mea-bench-attention's other flags
    bench_shapes: List[tuple]
    bench_flags: List[str]
    bench_timeout_s: int  # per benchmark process
    # decode benchmark: mea-bench-decode's flags (shape, context lengths, variants)
    decode_flags: List[str]
    decode_timeout_s: int
    paged_kernel_timeout_s: int  # acceptance/paged_kernel.py (exactness and timing)
    budget_s: int  # the whole run; a step that no longer fits is skipped


def train_flags(layers, hidden, heads, groups, seq, iters, lr, warmup) -> List[str]:
    """mea-pretrain flags of the training runs: a dense GPT of these sizes, two micro-batches of
    two sequences per step, the learning rate decaying to a tenth of `lr`."""
    sizes = dict(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                 num_query_groups=groups, seq_length=seq, num_experts=0, micro_batch_size=2,
                 global_batch_size=4, train_iters=iters, lr=lr, min_lr=lr / 10,
                 lr_warmup_fraction=warmup)
    return [token for name, value in sizes.items()
            for token in ("--" + name.replace("_", "-"), f"{value:g}")]


GPU_PLAN = Plan(
    mode="gpu",
    test_timeout_s=240,
    train_flags=[*train_flags(12, 2048, 16, 4, 4096, iters=300, lr=3e-4, warmup=0.03), "--bf16"],
    train_seconds=30.0,
    warmup_seconds=5.0,
    train_timeout_s=300,
    bench_shapes=[(2048, 16, 4), (4096, 32, 8)],
    bench_flags=[
        "--device", "cuda", "--bf16", "--seq-length", "4096", "--micro-batch-size", "1",
        "--repeats", "20", "--warmup", "3", "--model-layers", "2", "--model-micro-batches", "2",
        "--model-repeats", "8", "--vocab-size", "32768",
    ],
    bench_timeout_s=150,
    decode_flags=[
        "--bf16", "--num-layers", "8", "--hidden-size", "2048", "--num-attention-heads", "16",
        "--num-query-groups", "4", "--vocab-size", "32768", "--context-lengths", "2048", "8192",
        "--batch-size", "8", "--new-tokens", "64", "--repeats", "2",
    ],
    decode_timeout_s=120,
    paged_kernel_timeout_s=90,
    budget_s=465,
)

SMOKE_PLAN = Plan(
    mode="cpu-smoke",
    test_timeout_s=120,
    train_flags=train_flags(2, 64, 4, 2, 64, iters=24, lr=3e-3, warmup=0.05),
    # Generous: on an idle machine a run's 24 steps take about a second; the limits only matter
    # on a loaded one, where a run cut after a few steps could not show a falling loss.
    train_seconds=60.0,
    warmup_seconds=1.0,
    train_timeout_s=420,
    bench_shapes=[(64, 8, 2), (128, 8, 2)],
    bench_flags=[
        "--device", "cpu", "--seq-length", "64", "--micro-batch-size", "1", "--repeats", "2",
        "--warmup", "1", "--model-layers", "1", "--model-micro-batches", "1",
        "--model-repeats", "1", "--vocab-size", "128",
    ],
    bench_timeout_s=240,
    decode_flags=[
        "--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4",
        "--num-query-groups", "2", "--vocab-size", "128", "--context-lengths", "32", "64",
        "--new-tokens", "4", "--repeats", "1", "--threads", "1",
    ],
    decode_timeout_s=240,
    paged_kernel_timeout_s=240,
    budget_s=900,
)

# The three training runs: name -> the variant's mea-pretrain flags. MEA with virtual heads
# rebuilds the 4 (smoke: 2) composite K/V heads from half as many components.
TRAIN_VARIANTS = {
    "baseline": ["--attention-variant", "standard"],
    "mea-virtual": ["--attention-variant", "mea", "--mea-num-kv-components", "HALF_GROUPS"],
    "kha": ["--attention-variant", "kha"],
}
