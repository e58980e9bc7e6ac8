"""`mea-bench-decode`'s measurement: models of one shape that differ only in the attention
variant, a static KV cache filled with a prompt of each context length, greedy decoding timed
after it (`megatron_mea.inference.generate`); `opts` is the namespace of
`megatron_mea.cli.bench_decode`'s parser. The table's lines are INFO records of this module's
logger (rank 0's).
"""

import dataclasses
import json
import logging

logger = logging.getLogger(__name__)

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


def _model(run_args, variant):
    from megatron_mea.model.gpt import build_model, transformer_config

    fields = dict(VARIANTS[variant])
    if variant == "mea-half":
        fields["mea_num_kv_components"] = run_args.num_query_groups // 2
    args = dataclasses.replace(run_args, **fields)
    return build_model(args, transformer_config(args), pre_process=True, post_process=True)


def run(opts) -> None:
    """Run the grid: one line per (context length, variant), and `--json` written, on rank 0.
    Without CUDA, call it inside `megatron_mea.cpu.megatron_on_cpu()` (the tool does)."""
    import torch
    import torch.distributed as dist

    from megatron_mea.inference import generate
    from megatron_mea.model.args import RunArgs
    from megatron_mea.model.gpt import initialize

    run_args = RunArgs(
        num_layers=opts.num_layers, hidden_size=opts.hidden_size,
        num_attention_heads=opts.num_attention_heads, num_query_groups=opts.num_query_groups,
        kv_channels=opts.kv_channels, num_experts=opts.num_experts, vocab_size=opts.vocab_size,
        make_vocab_size_divisible_by=128, seq_length=max(opts.context_lengths) + opts.new_tokens,
        tensor_model_parallel_size=opts.tp, bf16=opts.bf16,
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
        logger.info(" ".join(f"{k}={v}" for k, v in setup.items()))
        logger.info(f"{'context':>8} {'variant':>9} {'KV bytes':>12} {'vs base':>8} "
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
                logger.info(f"{context:>8} {variant:>9} {row['kv_bytes']:>12} "
                            f"{row['kv_bytes_vs_base']:>8.3f} "
                            f"{row['decode_tokens_per_second']:>13.1f} "
                            f"{row['speed_vs_base']:>8.3f}")
    if speak and opts.json:
        with open(opts.json, "w") as handle:
            json.dump(dict(setup=setup, baseline=opts.variants[0], results=rows), handle, indent=1)
