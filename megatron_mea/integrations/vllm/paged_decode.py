"""Decode over the scaled-components cache, batched over a step's requests and blockwise.

Each decode request has one new token; its mixed query `q~_h [np, nc*hn]` (`prefill.GroupMix`)
meets every cached row `[K_0 ... K_nc-1 | r_0 ... r_ng-1 | V_0 ... V_nc-1]` of its blocks:

    logit_h(t) = scale * r_g(t) * (q~_h . K(t))            (g the group of query head h)
    out_h = sum_t softmax_t(logit_h) V(t)                   ([np, nc*hn]; `A_v` mixes it after)

Two implementations, one math. On the CPU with an fp32 or bf16 cache, `paged_decode` runs the
compiled C loop of `ops/cpu_decode.py`: each request's rows read once, in place through the block
table, in one parallel region on the engine's OpenMP threads, the heads' mixes inside. That is
what makes the scaled layout pay on the CPU: the torch path below reads the cache at about a
quarter of the speed of vLLM's C++ attention (a gather, two small GEMMs and a softmax per tile,
each a fork and join of the thread team), and with it the served hd64 Qwen3 MEA model gave 0.89x
of its original's tokens per CPU-second; with the C loop a decode step costs 0.8-1.2x the
original's over its full cache and the served model 1.37x (docs/inference.md).
`torch_paged_decode` serves every other case (fp64, fp16, no C compiler) and is the reference
the C loop is tested against.

`torch_paged_decode`: requests advance together over their block tables, a tile of `tile_tokens`
positions (whole blocks) at a time: one gather `[R', L, C]` of the tile's rows for the `R'`
requests still that long, two batched GEMMs, and an online softmax (running max, sum and output per
request and head, in fp32 or wider), so no request's whole rows are gathered at once. The requests
go in groups of about `gather_rows / tile_tokens`, so that a tile's gather (`gather_rows` rows, 1-2
MiB at `nc*hn = 256`) is still in the CPU's cache when the GEMMs read it; gathering every request's
tile at once measured slower than the per-request gather it replaced. Requests are taken longest
first, so the ones still active at a tile are a prefix of their group and every active request has
at least one valid position in it (no row is all masked). Positions at or past a request's length
(the tail of its last block, block-table entries past its blocks) are masked in the logits and
zeroed in the values (what an unused slot holds never reaches the output).

Shape legend: `R` decode requests, `np` query heads of this rank, `ng` its composite keys,
`W = nc*hn` the key and value width, `C` a cache row (`2*W + ng`), `bs` tokens per block,
`L` positions of a tile.
"""

import contextlib

import torch

from megatron_mea.ops import cpu_decode

# Positions per tile: a few blocks, so a step costs a handful of torch calls per tile.
TILE_TOKENS = 256
# Rows gathered at once (a group of requests times a tile).
GATHER_ROWS = 1024
# torch's intra-op threads for `torch_paged_decode` on the CPU. Its ops are small (a tile is a few
# hundred KiB) and many (about ten per tile and group of requests, eight layers a step), and each
# parallel op is a fork and join of the OpenMP team, which waits for a scheduler turn of every
# thread whenever the cores are shared: on the 2-core machine at load 25, one layer's decode of 8
# requests x 600 positions (hd64) took a median of 693 ms on 2 threads and 6.9 ms on one (1.7
# against 2.8 ms at best, the machine momentarily free).
CPU_THREADS = 1


def paged_decode(query: torch.Tensor, mix, kv_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: list, num_scales: int, scale: float) -> torch.Tensor:
    """Attention of one new token per request over its cached rows, the heads' mixes included.

    Args:
        query: `[R, np, hn]` RoPE'd queries, unmixed.
        mix: the layer's `prefill.GroupMix` on this rank.
        kv_cache, block_table, seq_lens, num_scales, scale: as `torch_paged_decode`'s.

    Returns:
        `[R, np, hn]` the composite heads' outputs `o_h`: the compiled C loop's
        (`ops/cpu_decode.py`) where it reads the cache and builds, else
        `mix.mix_outputs(torch_paged_decode(mix.mix_queries(query), ...))`.
    """
    width = mix.key.shape[0] * query.shape[-1]
    kernel = cpu_decode.load() if cpu_decode.supports(kv_cache, width) else None
    if kernel is not None:
        return cpu_decode.scaled_decode(kernel, query, mix.key_per_head, mix.value_per_head,
                                        kv_cache, block_table, seq_lens, num_scales, scale)
    outputs = torch_paged_decode(mix.mix_queries(query), kv_cache, block_table, seq_lens,
                                 num_scales, scale)
    return mix.mix_outputs(outputs)


def torch_paged_decode(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                       seq_lens: list, num_scales: int, scale: float,
                       tile_tokens: int = TILE_TOKENS,
                       gather_rows: int = GATHER_ROWS) -> torch.Tensor:
    """Attention of one new token per request over its cached rows, in torch (any device and
    dtype).

    Args:
        query: `[R, np, W]` mixed queries (`GroupMix.mix_queries`).
        kv_cache: `[blocks, 1, bs, C]`, rows `[K | r | V]` (`scaled_cache` module docstring).
        block_table: `[R, max_blocks]` block ids of each request.
        seq_lens: `[R]` positions each request has cached (its new token included), ints.
        num_scales: `ng`, the scales per row.
        scale: softmax scale.
        tile_tokens: positions per tile (rounded down to whole blocks, at least one).
        gather_rows: rows gathered at once (whole tiles, at least one).

    Returns:
        `[R, np, W]` per-component outputs (`GroupMix.mix_outputs` mixes them).
    """
    block_size = kv_cache.shape[2]
    blocks_per_tile = max(1, tile_tokens // block_size)
    group = max(1, gather_rows // (blocks_per_tile * block_size))
    order = sorted(range(query.shape[0]), key=lambda request: -seq_lens[request])
    output = torch.empty_like(query)
    with _threads(CPU_THREADS if query.device.type == "cpu" else None):
        for first in range(0, len(order), group):
            members = torch.tensor(order[first:first + group], device=query.device)
            output[members] = _decode_group(query[members], kv_cache[:, 0],
                                            block_table[members].long(),
                                            [seq_lens[m] for m in order[first:first + group]],
                                            num_scales, scale, blocks_per_tile)
    return output


@contextlib.contextmanager
def _threads(count):
    """torch's intra-op threads set to `count` (None: left alone) inside, put back after."""
    before = torch.get_num_threads()
    if count is None or count >= before:
        yield
        return
    # torch's own setter: vLLM's CPU worker replaces `torch.set_num_threads` with one that only
    # logs a warning, to keep its threads on the cores it bound them to. That binding is by
    # OpenMP thread number (the OMP/GOMP/KMP affinity variables it sets), which a smaller team
    # keeps: the team of one is the worker's own thread, and the full team comes back after.
    torch._C.set_num_threads(count)
    try:
        yield
    finally:
        torch._C.set_num_threads(before)


def _decode_group(query, rows, table, lengths, num_scales, scale, blocks_per_tile):
    """`paged_decode` of requests sorted longest first: `query [R, np, W]`, `rows [blocks, bs,
    C]`, `table [R, max_blocks]` (int64), `lengths` ints -> `[R, np, W]`."""
    num_requests, num_heads, width = query.shape
    block_size, groups = rows.shape[1], num_scales
    accumulate = torch.promote_types(query.dtype, torch.float32)
    device = query.device
    lengths_t = torch.tensor(lengths, device=device)
    maximum = torch.full((num_requests, num_heads), float("-inf"), dtype=accumulate,
                         device=device)
    total = torch.zeros(num_requests, num_heads, dtype=accumulate, device=device)
    acc = torch.zeros(num_requests, num_heads, width, dtype=accumulate, device=device)
    tile = blocks_per_tile * block_size
    # One buffer for every tile's rows (a fresh one per tile would be mapped page by page).
    buffer = torch.empty(num_requests * tile * rows.shape[-1], dtype=rows.dtype, device=device)
    for first in range(0, lengths[0], tile):
        active = sum(1 for length in lengths if length > first)  # a prefix: longest first
        columns = table[:active, first // block_size: first // block_size + blocks_per_tile]
        span = columns.shape[1] * block_size
        chunk = buffer[:active * span * rows.shape[-1]].view(-1, block_size, rows.shape[-1])
        torch.index_select(rows, 0, columns.reshape(-1), out=chunk)
        chunk = chunk.view(active, span, -1)  # [R', L, C]
        keys = chunk[:, :, :width]
        scales = chunk[:, :, width:width + groups]
        values = chunk[:, :, width + groups:]
        logits = torch.bmm(query[:active], keys.transpose(1, 2)).to(accumulate)
        logits = logits.view(active, groups, num_heads // groups, span)
        logits = logits * (scale * scales.transpose(1, 2).to(accumulate))[:, :, None, :]
        logits = logits.view(active, num_heads, span)
        if lengths[active - 1] < first + span:  # some request ends inside this tile
            valid = (first + torch.arange(span, device=device))[None, :] \
                < lengths_t[:active, None]  # [R', L]
            logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
            values = values.masked_fill(~valid[:, :, None], 0)
        new_max = torch.maximum(maximum[:active], logits.amax(-1))
        correction = torch.exp(maximum[:active] - new_max)
        probs = torch.exp(logits - new_max[:, :, None])
        total[:active] = total[:active] * correction + probs.sum(-1)
        acc[:active] = acc[:active] * correction[:, :, None] + torch.bmm(
            probs.to(values.dtype), values).to(accumulate)
        maximum[:active] = new_max
    return (acc / total[:, :, None]).to(query.dtype)
