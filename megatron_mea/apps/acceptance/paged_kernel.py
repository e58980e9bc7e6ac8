"""The acceptance step `paged_kernel`: the Triton kernel that serves MEA's scaled-components
cache on CUDA (`megatron_mea.ops.paged_attention`, what vLLM's backend of the plugin runs), driven
directly, without vLLM.

1. Exactness: a batch of requests (a first prefill, a chunk after cached tokens, decode steps,
   one through the split-KV form) on blocks scattered over a pool, in fp32 and bf16, against
   attention over the composite heads. Two references: the composite attention in fp64 (the
   truth) and the same torch attention in the kernel's dtype; the kernel passes when its error
   from the truth is at most twice the torch one's plus a floor (1e-5 fp32, 4e-3 bf16).
2. Speed, on the original model's layout at the same context lengths: MEA `nc = ng/2` through
   the kernel (one K/V head of `nc*hn`, the scales) against the original's `ng` composite heads
   through the same kernel without scales (what vLLM's Triton backend runs) and through torch's
   SDPA on contiguous heads (FlashAttention in bf16 on a GPU); decode steps of a batch and a
   first prefill; median milliseconds and ratios (MEA / original).

    python -m megatron_mea.apps.acceptance.paged_kernel --json OUT.json [--smoke]

`--smoke` is the CPU form: tiny shapes, fp32 only, under Triton's interpreter (the runner sets
`TRITON_INTERPRET=1`; the timings mean nothing there). Where triton does not import, the step is
not available (it writes `not_available` and exits 0). Imports torch and triton only, inside
`main` (the acceptance package imports the standard library alone at load time).

Shape legend: `R` requests, `S` cached positions, `np` query heads, `ng` composite K/V heads,
`nc` components, `hn` head dim, `bs` tokens per block.
"""

import argparse
import json
import statistics
import sys
import time

PLANS = {
    "gpu": dict(heads=16, groups=4, components=2, head_dim=128, block=16,
                exact=dict(cached=[0, 300, 1000, 37], new=[200, 64, 1, 1]),
                decode_batch=8, contexts=[2048, 8192], prefill_batch=2, prefill_length=2048,
                dtypes=["float32", "bfloat16"], timing_dtype="bfloat16", repeats=20, warmup=3),
    "smoke": dict(heads=4, groups=2, components=1, head_dim=16, block=4,
                  exact=dict(cached=[0, 9, 20, 5], new=[7, 3, 1, 1]),
                  decode_batch=2, contexts=[24], prefill_batch=1, prefill_length=12,
                  dtypes=["float32"], timing_dtype="float32", repeats=1, warmup=0),
}
FLOORS = {"float32": 1e-5, "bfloat16": 4e-3}
EPS = 1e-6


def composite_attention(torch, query, keys, values, key_mix, value_mix, weight, scale, dtype):
    """The reference: causal GQA over the RMS-normed composite heads, the scores and outputs in
    `dtype`, the softmax in fp32 (or fp64). `query [s, np, hn]`, `keys`, `values [S, nc, hn]`
    -> `[s, np, hn]`."""
    heads, groups = query.shape[1], key_mix.shape[1]
    mixed = torch.einsum("tcd,cg->tgd", keys, key_mix)
    composite_keys = mixed * torch.rsqrt(mixed.square().mean(-1, keepdim=True) + EPS) * weight
    composite_values = torch.einsum("tcd,cg->tgd", values, value_mix)
    group = torch.arange(heads, device=query.device) // (heads // groups)
    q, k, v = (t.to(dtype) for t in (query, composite_keys[:, group], composite_values[:, group]))
    scores = torch.einsum("shd,thd->hst", q, k).to(torch.promote_types(dtype, torch.float32))
    s, positions = query.shape[0], keys.shape[0]
    mask = torch.ones(s, positions, dtype=torch.bool, device=query.device).triu(positions - s + 1)
    probs = (scores * scale).masked_fill(mask, float("-inf")).softmax(-1).to(dtype)
    return torch.einsum("hst,thd->shd", probs, v)


class Pool:
    """A paged cache of MEA rows `[blocks, bs, C]` (`C = nc*hn + ng + nc*hn`: keys, scales,
    values) with each request's blocks scattered over it, and the kernel's views of it."""

    def __init__(self, torch, lengths, plan, dtype, device, generator):
        bs, width = plan["block"], plan["components"] * plan["head_dim"]
        self.width, self.groups = width, plan["groups"]
        counts = [-(-length // bs) for length in lengths]
        order = torch.randperm(sum(counts) + 1, generator=generator).to(device)
        self.cache = torch.zeros(sum(counts) + 1, bs, 2 * width + self.groups, dtype=dtype,
                                 device=device)
        self.block_table = torch.zeros(len(lengths), max(counts), dtype=torch.int32,
                                       device=device)
        used = 0
        for request, count in enumerate(counts):
            self.block_table[request, :count] = order[used:used + count]
            used += count
        self.bs = bs

    def write(self, request, rows):
        """`rows [S, C]` at positions 0..S-1 of `request`."""
        positions = range(rows.shape[0])
        blocks = self.block_table[request, [p // self.bs for p in positions]].long()
        self.cache[blocks, [p % self.bs for p in positions]] = rows.to(self.cache.dtype)

    def views(self):
        keys = self.cache[..., :self.width].unsqueeze(2)
        scales = self.cache[..., self.width:self.width + self.groups]
        values = self.cache[..., self.width + self.groups:].unsqueeze(2)
        return keys, values, scales


def exactness(torch, ops, plan, dtype_name, device):
    """Step 1 for one dtype: the largest errors of the kernel and of torch in that dtype from
    the fp64 composite attention, per request, and the verdict."""
    dtype = getattr(torch, dtype_name)
    generator = torch.Generator().manual_seed(0)
    heads, groups, nc, hn = (plan[k] for k in ("heads", "groups", "components", "head_dim"))
    cached, new = plan["exact"]["cached"], plan["exact"]["new"]
    lengths = [c + n for c, n in zip(cached, new)]
    scale = hn ** -0.5

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(device)

    key_mix, value_mix, weight = randn(nc, groups), randn(nc, groups), 1 + 0.3 * randn(hn)
    group = torch.arange(heads, device=device) // (heads // groups)
    pool = Pool(torch, lengths, plan, dtype, device, generator)
    queries, truth, torch_errors, data = [], [], [], []
    for request, length in enumerate(lengths):
        query, keys, values = randn(length, heads, hn), randn(length, nc, hn), randn(length, nc, hn)
        scales = torch.rsqrt(torch.einsum("tcd,cg->tgd", keys, key_mix).square().mean(-1) + EPS)
        pool.write(request, torch.cat([(keys * weight).reshape(length, -1), scales,
                                       values.reshape(length, -1)], -1))
        step = query[cached[request]:]
        mixed = torch.einsum("shd,ch->shcd", step, key_mix[:, group]).reshape(len(step), heads, -1)
        queries.append(mixed)
        want = composite_attention(torch, step, keys, values, key_mix, value_mix, weight, scale,
                                   torch.float64)
        got = composite_attention(torch, step.to(dtype), keys.to(dtype), values.to(dtype),
                                  key_mix.to(dtype), value_mix.to(dtype), weight.to(dtype),
                                  scale, dtype)
        truth.append(want)
        torch_errors.append((got.double() - want).abs().max().item())
    query = torch.cat(queries).to(dtype)
    starts = torch.tensor([0] + new, device=device).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    keys, values, scales = pool.views()
    rows = {}
    for form, split in (("one pass", None),
                        ("split-KV", ops.SplitBuffers.allocate(len(lengths), heads, nc * hn,
                                                               device, segments=4))):
        # The split-KV form serves decode-only steps: the last two requests alone.
        if split is not None:
            chosen = [r for r in range(len(lengths)) if new[r] == 1]
            first = int(starts[chosen[0]])
            q = query[first:first + len(chosen)]
            bounds = torch.arange(len(chosen) + 1, dtype=torch.int32, device=device)
            lens, table, max_query = seq_lens[chosen], pool.block_table[chosen], 1
        else:
            chosen, q, bounds, lens, table = list(range(len(lengths))), query, starts, seq_lens, \
                pool.block_table
            max_query = max(new)
        out = torch.zeros(q.shape[0], heads, nc * hn, dtype=dtype, device=device)
        ops.paged_attention(q, keys, values, out, bounds, lens, table, max_query, scale,
                            key_scales=scales, split=split)
        errors = {}
        for index, request in enumerate(chosen):
            part = out[int(bounds[index]):int(bounds[index + 1])].view(-1, heads, nc, hn)
            got = torch.einsum("shcd,ch->shd", part.double(), value_mix[:, group])
            errors[request] = (got - truth[request]).abs().max().item()
        limit = {r: 2 * torch_errors[r] + FLOORS[dtype_name] for r in chosen}
        rows[form] = {"kernel_error": errors, "torch_error": {r: torch_errors[r] for r in chosen},
                      "ok": all(errors[r] <= limit[r] for r in chosen)}
    return {"requests": {"cached": cached, "new": new}, **rows,
            "ok": all(row["ok"] for row in rows.values())}


def _timer(torch, device, repeats, warmup):
    """`time(function)`: median milliseconds of `repeats` calls after `warmup`."""

    def time_it(function):
        for _ in range(warmup):
            function()
        samples = []
        for _ in range(repeats):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                function()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end))
            else:
                began = time.perf_counter()
                function()
                samples.append((time.perf_counter() - began) * 1e3)
        return statistics.median(samples)

    return time_it


def speed(torch, ops, plan, device, batch, context, new):
    """Step 2 at one point: `batch` requests of `context` positions, the last `new` of them this
    step's (1: decode), through the three routes; milliseconds and ratios."""
    dtype = getattr(torch, plan["timing_dtype"])
    heads, groups, nc, hn = (plan[k] for k in ("heads", "groups", "components", "head_dim"))
    generator = torch.Generator().manual_seed(1)
    scale = hn ** -0.5
    lengths = [context] * batch
    time_it = _timer(torch, device, plan["repeats"], plan["warmup"])
    starts = torch.arange(batch + 1, dtype=torch.int32, device=device) * new
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)

    def split_for(head_size):  # decode steps split each request over segments, as in vLLM
        return ops.SplitBuffers.allocate(batch, heads, head_size, device) if new == 1 else None

    mea = Pool(torch, lengths, plan, dtype, device, generator)
    mea.cache.normal_()
    mea.cache[..., mea.width:mea.width + groups] = 1 + 0.1 * mea.cache[
        ..., mea.width:mea.width + groups]
    keys, values, scales = mea.views()
    query = torch.randn(batch * new, heads, nc * hn, dtype=dtype, device=device)
    out = torch.empty_like(query)
    split = split_for(nc * hn)
    mea_ms = time_it(lambda: ops.paged_attention(query, keys, values, out, starts, seq_lens,
                                                 mea.block_table, new, scale, key_scales=scales,
                                                 split=split))
    # The original: ng composite heads of hn per token, keys and values in blocks of their own.
    original = torch.randn(mea.cache.shape[0], plan["block"], 2, groups, hn, dtype=dtype,
                           device=device)
    query = torch.randn(batch * new, heads, hn, dtype=dtype, device=device)
    out = torch.empty_like(query)
    split = split_for(hn)
    kernel_ms = time_it(lambda: ops.paged_attention(query, original[:, :, 0], original[:, :, 1],
                                                    out, starts, seq_lens, mea.block_table, new,
                                                    scale, split=split))
    q = torch.randn(batch, heads, new, hn, dtype=dtype, device=device)
    k, v = (torch.randn(batch, groups, context, hn, dtype=dtype, device=device)
            for _ in range(2))
    sdpa_ms, sdpa_route = _time_sdpa(torch, time_it, q, k, v, new > 1, scale)
    return {"mea_kernel_ms": mea_ms, "original_kernel_ms": kernel_ms, "original_sdpa_ms": sdpa_ms,
            "sdpa": sdpa_route,
            "vs_original_kernel": mea_ms / kernel_ms, "vs_original_sdpa": mea_ms / sdpa_ms,
            "kv_bytes_per_token_vs_original": (2 * nc * hn + groups) / (2 * groups * hn)}


def _time_sdpa(torch, time_it, q, k, v, causal, scale):
    """SDPA over `q [R, np, s, hn]`, `k`, `v [R, ng, S, hn]`: on CUDA FlashAttention alone (with
    its native GQA where torch passes `enable_gqa` to it, else with the K/V heads repeated),
    elsewhere torch's choice. Returns (milliseconds, the route)."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if q.device.type != "cuda":
        return time_it(lambda: sdpa(q, k, v, is_causal=causal, scale=scale,
                                    enable_gqa=True)), "torch's choice, native GQA"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        try:
            return time_it(lambda: sdpa(q, k, v, is_causal=causal, scale=scale,
                                        enable_gqa=True)), "flash, native GQA"
        except RuntimeError:
            per_group = q.shape[1] // k.shape[1]
            k, v = (t.repeat_interleave(per_group, dim=1) for t in (k, v))
            return time_it(lambda: sdpa(q, k, v, is_causal=causal,
                                        scale=scale)), "flash, K/V heads repeated"


def run(plan_name: str) -> dict:
    """Both parts of the step for a plan (`gpu` or `smoke`); `not_available` without triton."""
    import torch

    try:
        from megatron_mea.ops import paged_attention as ops
    except ImportError as exc:
        return {"not_available": f"triton does not import here ({exc}); the kernel is "
                                 "checked under Triton's interpreter in tests/vllm"}
    plan = PLANS[plan_name]
    device = torch.device("cuda" if plan_name == "gpu" else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 references are IEEE
    result = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
              "shape": {k: plan[k] for k in ("heads", "groups", "components", "head_dim",
                                             "block")},
              "exact": {name: exactness(torch, ops, plan, name, device)
                        for name in plan["dtypes"]}}
    result["decode"] = {str(context): speed(torch, ops, plan, device, plan["decode_batch"],
                                            context, 1) for context in plan["contexts"]}
    length = plan["prefill_length"]
    result["prefill"] = {str(length): speed(torch, ops, plan, device, plan["prefill_batch"],
                                            length, length)}
    result["timing"] = {"dtype": plan["timing_dtype"], "decode_batch": plan["decode_batch"],
                        "prefill_batch": plan["prefill_batch"], "repeats": plan["repeats"]}
    result["ok"] = all(row["ok"] for row in result["exact"].values())
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_mea.apps.acceptance.paged_kernel",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="where the result goes")
    parser.add_argument("--smoke", action="store_true", help="the CPU form (module docstring)")
    args = parser.parse_args(argv)
    result = run("smoke" if args.smoke else "gpu")
    with open(args.json, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=1)
    return 0 if result.get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
