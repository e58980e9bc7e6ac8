"""`mea-bench-decode`: decode tokens/s and KV-cache bytes of MEA / KHA against the baseline.

Builds randomly initialised models of one shape that differ only in the attention variant, fills
a static KV cache with a prompt of each context length and times greedy decoding after it
(`megatron_mea.inference.generate`). Not a test: numbers depend on the machine.

    mea-bench-decode                                               # CPU-sized defaults
    mea-bench-decode --num-layers 16 --hidden-size 2048 --num-attention-heads 16 \
        --num-query-groups 8 --context-lengths 1024 4096 16384 --batch-size 8 --bf16   # a GPU
    torchrun --nproc-per-node 2 --no-python mea-bench-decode --tp 2

Variants: `baseline` (GQA with ng groups), `mea` (nc = ng), `mea-half` (nc = ng/2: the cache is
half the baseline's K/V plus one scalar per composite head and token with qk_layernorm; decoding
attends over the cached components directly), `kha` (linear). "vs base" compares with the first
variant listed (the baseline by default), measured in the same run. `--json FILE` writes the
table (KV bytes, decode tokens/s and both ratios per context length and variant).
"""

import argparse
import dataclasses
import json
import os
import sys

from megatron_mea.cpu import megatron_on_cpu
from megatron_mea.runtime.argparsing import ArgumentParser

VARIANTS = {
    "baseline": dict(attention_variant="standard"),
    "mea": dict(attention_variant="mea", mea_mix_init="normal"),
    "mea-half": dict(attention_variant="mea", mea_mix_init="normal"),  # nc set from ng below
    "kha": dict(attention_variant="kha", kha_variant="linear"),
}


class _Ids:
    """Prompts are token ids already; only the vocabulary size matters."""

    def __init__(self, vocab_size):
        self.vocab_size = vocab_size

    def detokenize(self, ids):
        return ""


def build_parser() -> argparse.ArgumentParser:
    """Flags: the model shape, the variants, the context lengths."""
    parser = ArgumentParser(
        prog="mea-bench-decode", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--num-query-groups", type=int, default=4)
    parser.add_argument("--kv-channels", type=int, default=None)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--num-experts", type=int, default=None, help="MoE layers. Default: dense")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--context-lengths", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--new-tokens", type=int, default=32, help="decoded tokens per row")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs; the best is kept")
    parser.add_argument("--tp", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--threads", type=int, help="torch CPU threads. Default: torch's choice")
    parser.add_argument("--qk-layernorm", action=argparse.BooleanOptionalAction, default=True,
                        help="RMS-normalise q and k per head. Default: on")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    return parser


def _model(run_args, variant):
    from megatron_mea.model.gpt import build_model, transformer_config

    fields = dict(VARIANTS[variant])
    if variant == "mea-half":
        fields["mea_num_kv_components"] = run_args.num_query_groups // 2
    args = dataclasses.replace(run_args, **fields)
    return build_model(args, transformer_config(args), pre_process=True, post_process=True)


@megatron_on_cpu()
def main(argv=None) -> int:
    """Run the grid and print one line per (context length, variant).

    Args:
        argv: the arguments. Default: `sys.argv[1:]`.

    Returns:
        The exit status (0; argparse exits with 2 on usage errors).
    """
    opts = build_parser().parse_args(argv)
    import torch
    import torch.distributed as dist

    from megatron_mea.apps.training.arguments import PretrainArgs
    from megatron_mea.inference import generate
    from megatron_mea.model.gpt import initialize

    run_args = PretrainArgs(
        num_layers=opts.num_layers, hidden_size=opts.hidden_size,
        num_attention_heads=opts.num_attention_heads, num_query_groups=opts.num_query_groups,
        kv_channels=opts.kv_channels, num_experts=opts.num_experts, vocab_size=opts.vocab_size,
        make_vocab_size_divisible_by=128, seq_length=max(opts.context_lengths) + opts.new_tokens,
        tensor_model_parallel_size=opts.tp, bf16=opts.bf16, mock_data=True,
        moe_router_load_balancing_type="none", qk_layernorm=opts.qk_layernorm,
    )
    if opts.threads:
        torch.set_num_threads(opts.threads)
    initialize(run_args)
    speak = dist.get_rank() == 0
    tokenizer = _Ids(opts.vocab_size)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    setup = dict(device=device, tp=opts.tp, layers=opts.num_layers, hidden=opts.hidden_size,
                 heads=opts.num_attention_heads, groups=opts.num_query_groups,
                 batch=opts.batch_size, new_tokens=opts.new_tokens,
                 dtype="bf16" if opts.bf16 else "fp32", threads=torch.get_num_threads(),
                 qk_layernorm=opts.qk_layernorm)
    if speak:
        print(" ".join(f"{k}={v}" for k, v in setup.items()))
        print(f"{'context':>8} {'variant':>9} {'KV bytes':>12} {'vs base':>8} "
              f"{'decode tok/s':>13} {'vs base':>8}")
    models = {v: _model(run_args, v) for v in opts.variants}
    generator = torch.Generator().manual_seed(0)
    rows = []
    for context in opts.context_lengths:
        prompts = torch.randint(0, opts.vocab_size, (opts.batch_size, context), generator=generator)
        prompts = prompts.tolist()
        for model in models.values():
            generate(model, tokenizer, [p[:8] for p in prompts], 2, stop_at_eod=False)  # warm-up
        best = {}
        # Variants interleaved, best of the repeats: load from other processes hits all alike.
        for _ in range(opts.repeats):
            for variant, model in models.items():
                stats = generate(
                    model, tokenizer, prompts, opts.new_tokens, stop_at_eod=False
                ).stats
                if variant not in best or stats.decode_seconds < best[variant].decode_seconds:
                    best[variant] = stats
        base = best[opts.variants[0]]
        for variant, stats in best.items():
            row = dict(
                context=context, variant=variant, kv_bytes=stats.kv_cache_bytes_total,
                kv_bytes_vs_base=stats.kv_cache_bytes_total / base.kv_cache_bytes_total,
                decode_tokens_per_second=stats.decode_tokens_per_second,
                speed_vs_base=stats.decode_tokens_per_second / base.decode_tokens_per_second,
            )
            rows.append(row)
            if speak:
                print(f"{context:>8} {variant:>9} {row['kv_bytes']:>12} "
                      f"{row['kv_bytes_vs_base']:>8.3f} {row['decode_tokens_per_second']:>13.1f} "
                      f"{row['speed_vs_base']:>8.3f}", flush=True)
    if speak and opts.json:
        with open(opts.json, "w") as handle:
            json.dump(dict(setup=setup, baseline=opts.variants[0], results=rows), handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
