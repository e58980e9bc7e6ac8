"""Per-layer attention time of MEA's component caches against the original's, side by side in
one run (a benchmark that prints, not a timed test; vLLM venv, CPU):

    .venv-vllm/bin/python -m tests.vllm.bench_attention_paths [--prompt 1024] [--head-dim 128] \\
        [--requests 16] [--context 1024] [--dtype float32]

One layer of `np` query heads over `ng` K/V heads (the original) or `nc` components (MEA), each
as vLLM runs it: the cache write of the step's tokens and the attention, on vLLM's cache with
its blocks of `--block` tokens. Rows:
- original: vLLM's CPU attention (`cpu_attn_reshape_and_cache`, `cpu_attention_with_kv_cache`)
  over the `ng` composite heads;
- component trick: the same kernel over the plain component cache with the mixed queries for
  every token (what the plain component cache ran before prefill rebuilt the composites);
- components: `components_cpu.ComponentsImpl` (prefill over rebuilt composites, decode by
  the trick);
- scaled components: `scaled_cache.ScaledComponentsImpl` (prefill over rebuilt composites,
  decode by `paged_decode`).
Prefill: one request of `--prompt` new tokens (nothing cached). Decode: `--requests` requests
of one new token after `--context - 1` cached. Each the best of `--repeats` timings, in ms, and
its ratio to the original's.
"""

import argparse
import sys
import time
import types

import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from megatron_mea.integrations.vllm.attention import VLLMHeadMix
from megatron_mea.integrations.vllm.components_cpu import ComponentsImpl, plan
from megatron_mea.integrations.vllm.scaled_cache import (
    ScaledComponentsImpl,
    ScaledComponentsMetadata,
    leading_decodes,
)


def best_ms(step, repeats):
    step()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


class Batch:
    """A step of `R` requests (`cached`, `new` tokens each), blocks scattered over the pool."""

    def __init__(self, cached, new, block):
        self.cached, self.new, self.block = cached, new, block
        self.lengths = [c + n for c, n in zip(cached, new)]
        counts = [-(-length // block) for length in self.lengths]
        order = torch.randperm(sum(counts))
        self.num_blocks = sum(counts)
        self.block_table = torch.zeros(len(counts), max(counts), dtype=torch.int32)
        used = 0
        for request, count in enumerate(counts):
            self.block_table[request, :count] = order[used:used + count]
            used += count
        self.starts = [0]
        for count in new:
            self.starts.append(self.starts[-1] + count)
        self.step_slots = torch.cat([self.slots(r, torch.arange(c, c + n))
                                     for r, (c, n) in enumerate(zip(cached, new))])
        self.all_slots = torch.cat([self.slots(r, torch.arange(length))
                                    for r, length in enumerate(self.lengths)])

    def slots(self, request, positions):
        return self.block_table[request, positions // self.block].long() * self.block \
            + positions % self.block

    def common(self):
        starts = torch.tensor(self.starts, dtype=torch.int32)
        return CommonAttentionMetadata(
            query_start_loc=starts, query_start_loc_cpu=starts,
            seq_lens=torch.tensor(self.lengths, dtype=torch.int32), num_reqs=len(self.lengths),
            num_actual_tokens=self.starts[-1], max_query_len=max(self.new),
            max_seq_len=max(self.lengths), block_table_tensor=self.block_table,
            slot_mapping=self.step_slots)


def stock(batch, query, heads, width, dtype, repeats):
    """vLLM's CPU attention (write, then attention) over `heads` K/V heads of `width`."""
    isa = _get_attn_isa(dtype, batch.block, width)
    cache = torch.zeros(batch.num_blocks, heads, 2 * batch.block, width, dtype=dtype)
    key_cache, value_cache = cache.chunk(2, dim=2)
    every = torch.randn(batch.all_slots.shape[0], heads, width, dtype=dtype)
    ops.cpu_attn_reshape_and_cache(every, every, key_cache, value_cache, batch.all_slots, isa)
    new = torch.randn(batch.starts[-1], heads, width, dtype=dtype)
    common = batch.common()
    output = torch.empty_like(query)

    def step():
        ops.cpu_attn_reshape_and_cache(new, new, key_cache, value_cache, batch.step_slots, isa)
        schedule = ops.cpu_attn_get_scheduler_metadata(
            len(batch.lengths), query.shape[1], heads, width, common.seq_lens, dtype,
            common.query_start_loc, True, -1, isa, False)
        ops.cpu_attention_with_kv_cache(query, key_cache, value_cache, output,
                                        common.query_start_loc, common.seq_lens,
                                        width**-0.5, True, None, -1, batch.block_table, 0.0,
                                        schedule, None)

    return best_ms(step, repeats)


def plugin(batch, query, impl, head_size, value_width, layer, dtype, metadata, repeats):
    """One of the plugin's impls (write, then attention) on its cache."""
    cache = torch.zeros(batch.num_blocks, 1, batch.block, head_size + value_width, dtype=dtype)
    every = len(batch.all_slots)
    impl.do_kv_cache_update(layer, torch.randn(every, 1, head_size, dtype=dtype),
                            torch.randn(every, 1, value_width, dtype=dtype), cache,
                            batch.all_slots)
    key = torch.randn(batch.starts[-1], 1, head_size, dtype=dtype)
    value = torch.randn(batch.starts[-1], 1, value_width, dtype=dtype)
    if head_size > value_width:  # the scales: inverse RMS, about 1
        key[..., value_width:] = 1 + 0.1 * key[..., value_width:]
    output = torch.empty(batch.starts[-1], query.shape[1], value_width, dtype=dtype)

    def step():
        impl.do_kv_cache_update(layer, key, value, cache, batch.step_slots)
        impl.forward(layer, query, key, value, cache, metadata, output)

    return best_ms(step, repeats)


def measure(batch, args):
    """{row: ms} for one batch."""
    dtype = getattr(torch, args.dtype)
    np_, ng, nc, hn = args.heads, args.groups, args.components, args.head_dim
    width = nc * hn
    head_mix = VLLMHeadMix(nc, ng).to(dtype)
    torch.nn.init.normal_(head_mix.key_weight)
    torch.nn.init.normal_(head_mix.value_weight)
    tokens = batch.starts[-1]
    plain_query = torch.randn(tokens, np_, hn, dtype=dtype)
    times = {
        "original": stock(batch, plain_query, ng, hn, dtype, args.repeats),
        "component trick": stock(batch, torch.randn(tokens, np_, width, dtype=dtype), 1, width,
                                 dtype, args.repeats),
    }
    isa = _get_attn_isa(dtype, batch.block, width)
    layer = types.SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0)
    impl = ComponentsImpl(np_, width, hn**-0.5, 1, head_dim=hn, head_mix=head_mix,
                          num_groups=ng)
    query = torch.nn.functional.pad(plain_query, (0, width - hn))
    times["components"] = plugin(batch, query, impl, width, width, layer, dtype,
                                 plan(batch.common(), isa, np_, width, dtype), args.repeats)
    impl = ScaledComponentsImpl(np_, width + ng, hn**-0.5, 1, num_scales=ng, head_dim=hn,
                                head_mix=head_mix)
    query = torch.nn.functional.pad(plain_query, (0, width + ng - hn))
    metadata = ScaledComponentsMetadata(
        num_actual_tokens=tokens, query_starts=batch.starts, seq_lens=batch.lengths,
        block_table=batch.block_table, slot_mapping=batch.step_slots,
        num_decodes=leading_decodes(batch.starts))
    times["scaled components"] = plugin(batch, query, impl, width + ng, width, None, dtype,
                                        metadata, args.repeats)
    return times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=1024, help="prefill tokens")
    parser.add_argument("--requests", type=int, default=16, help="decode requests")
    parser.add_argument("--context", type=int, default=1024, help="decode positions")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--components", type=int, default=2)
    parser.add_argument("--block", type=int, default=128, help="tokens per KV block")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, help="torch's threads (default: torch's own)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    prefill = measure(Batch([0], [args.prompt], args.block), args)
    decode = measure(Batch([args.context - 1] * args.requests, [1] * args.requests,
                           args.block), args)
    print(f"one layer, {args.heads} query / {args.groups} K/V heads of {args.head_dim}, "
          f"nc = {args.components}, {args.dtype}, {args.block}-token blocks, "
          f"{torch.get_num_threads()} threads")
    print(f"| layout | prefill {args.prompt} tokens, ms | vs original "
          f"| decode {args.requests} x {args.context}, ms | vs original |")
    print("|---|---|---|---|---|")
    for row in prefill:
        print(f"| {row} | {prefill[row]:.2f} | {prefill[row] / prefill['original']:.2f}x "
              f"| {decode[row]:.2f} | {decode[row] / decode['original']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
