"""Decode over the scaled-components cache, batched over a step's requests and blockwise.

Each decode request has one new token; its mixed query `q~_h [np, nc*hn]` (`prefill.GroupMix`)
meets every cached row `[K_0 ... K_nc-1 | r_0 ... r_ng-1 | V_0 ... V_nc-1]` of its blocks:

    logit_h(t) = scale * r_g(t) * (q~_h . K(t))            (g the group of query head h)
    out_h = sum_t softmax_t(logit_h) V(t)                   ([np, nc*hn]; `A_v` mixes it after)

All requests advance together over their block tables, a tile of `tile_tokens` positions
(whole blocks) at a time: one gather `[R', L, C]` of the tile's rows for the `R'` requests
still that long, two batched GEMMs, and an online softmax (running max `m`, sum `l` and
output `acc` per request and head, fp32 or wider), so no request's whole rows are ever
gathered. Requests are taken longest first, so the ones still active at a tile are a prefix
of the order and every active request has at least one valid position in it (no row is all
masked). Positions at or past a request's length (the tail of its last block, block-table
entries past its blocks) are masked in the logits and zeroed in the values (what an unused
slot holds is never read into the output).

Shape legend: `R` decode requests, `np` query heads of this rank, `ng` its composite keys,
`W = nc*hn` the key and value width, `C` a cache row (`2*W + ng`), `bs` tokens per block,
`L` positions of a tile.
"""

import torch

# Positions per tile: a few blocks, so a step costs a handful of torch calls per tile.
TILE_TOKENS = 256


def paged_decode(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: list, num_scales: int, scale: float,
                 tile_tokens: int = TILE_TOKENS) -> torch.Tensor:
    """Attention of one new token per request over its cached rows.

    Args:
        query: `[R, np, W]` mixed queries (`GroupMix.mix_queries`).
        kv_cache: `[blocks, 1, bs, C]`, rows `[K | r | V]` (`scaled_cache` module docstring).
        block_table: `[R, max_blocks]` block ids of each request.
        seq_lens: `[R]` positions each request has cached (its new token included), ints.
        num_scales: `ng`, the scales per row.
        scale: softmax scale.
        tile_tokens: positions per tile (rounded down to whole blocks, at least one).

    Returns:
        `[R, np, W]` per-component outputs (`GroupMix.mix_outputs` mixes them).
    """
    num_requests, num_heads, width = query.shape
    block_size = kv_cache.shape[2]
    rows = kv_cache[:, 0]  # [blocks, bs, C]
    accumulate = torch.promote_types(query.dtype, torch.float32)
    order = sorted(range(num_requests), key=lambda request: -seq_lens[request])
    lengths = [seq_lens[request] for request in order]
    index = torch.tensor(order, device=query.device)
    sorted_query = query[index]
    table = block_table[index].long()
    lengths_t = torch.tensor(lengths, device=query.device)
    maximum = torch.full((num_requests, num_heads), float("-inf"), dtype=accumulate,
                         device=query.device)
    total = torch.zeros(num_requests, num_heads, dtype=accumulate, device=query.device)
    acc = torch.zeros(num_requests, num_heads, width, dtype=accumulate, device=query.device)
    blocks_per_tile = max(1, tile_tokens // block_size)
    tile = blocks_per_tile * block_size
    groups = num_scales
    # One buffer for every tile's rows (a fresh one per tile would be mapped page by page).
    buffer = torch.empty(num_requests * tile * rows.shape[-1], dtype=rows.dtype,
                         device=rows.device)
    for first in range(0, lengths[0], tile):
        active = sum(1 for length in lengths if length > first)  # a prefix: longest first
        columns = table[:active, first // block_size: first // block_size + blocks_per_tile]
        span = columns.shape[1] * block_size
        chunk = buffer[:active * span * rows.shape[-1]].view(active * columns.shape[1],
                                                             block_size, -1)
        torch.index_select(rows, 0, columns.reshape(-1), out=chunk)
        chunk = chunk.view(active, span, -1)  # [R', L, C]
        keys = chunk[:, :, :width]
        scales = chunk[:, :, width:width + groups]
        values = chunk[:, :, width + groups:]
        logits = torch.bmm(sorted_query[:active], keys.transpose(1, 2)).to(accumulate)
        logits = logits.view(active, groups, num_heads // groups, span)
        logits = logits * (scale * scales.transpose(1, 2).to(accumulate))[:, :, None, :]
        logits = logits.view(active, num_heads, span)
        if lengths[active - 1] < first + span:  # some request ends inside this tile
            valid = (first + torch.arange(span, device=query.device))[None, :] \
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
    output = torch.empty_like(query)
    output[index] = (acc / total[:, :, None]).to(query.dtype)
    return output
