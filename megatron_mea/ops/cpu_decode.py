"""Decode over MEA's scaled-components cache in compiled C on the CPU (`cpu_decode.c`).

The vLLM plugin's decode (`integrations/vllm/paged_decode.py`) reads each cached row
`[K (W) | r (ng) | V (W)]` once per request for every query head `h` of group `g = h // (np/ng)`:

    q~_h = [A_k[h, 0] q_h ... A_k[h, nc-1] q_h]
    logit_h(t) = scale * r_g(t) * (q~_h . K(t))
    o_h = sum_c A_v[h, c] (sum_t softmax_t(logit_h) V_c(t))

In torch that is a gather, two small GEMMs and an online softmax per tile, about ten ops each a
fork and join of the thread team; the C loop is one pass over the rows in one parallel region, the
mixes of queries and outputs included. It is compiled on first use with the system's C compiler
(`CC`, else `cc`) for this CPU (`-march=native`) into `~/.cache/megatron_mea/kernels`
(`XDG_CACHE_HOME` honoured), keyed by the source, the flags and the CPU's feature flags, and loaded
with ctypes: no Python or torch headers, 1-3 s. Without a compiler `load()` returns None,
logs why once, and the caller keeps its torch path.

Shape legend: `R` decode requests, `np` query heads, `ng` scales per row, `nc` components,
`hn` head dim, `W = nc*hn`, `C = 2*W + ng` a cache row, `bs` tokens per block.
"""

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_decode.c")
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
# The cache's dtypes the C loop reads, as its `kind` argument.
ROW_KINDS = {torch.float32: 0, torch.bfloat16: 1}


def supports(kv_cache: torch.Tensor, width: int) -> bool:
    """Whether the C loop reads this cache of `width`-wide keys and values (`W`): on the CPU,
    fp32 or bf16, rows contiguous, `width` a multiple of its 8-float vectors."""
    return (kv_cache.device.type == "cpu" and kv_cache.dtype in ROW_KINDS
            and kv_cache.stride(-1) == 1 and width % 8 == 0)


@functools.lru_cache(maxsize=None)
def load() -> Optional[ctypes.CDLL]:
    """The compiled kernel, built on first use into the user's cache (module docstring); None
    where it cannot be."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return build(cache / "megatron_mea" / "kernels")


def build(directory: Path) -> Optional[ctypes.CDLL]:
    """`cpu_decode.c` compiled into `directory` (once: the library's name is the build's key)
    and loaded; None, with one warning saying why, without a working C compiler or the
    source."""
    compiler = os.environ.get("CC") or shutil.which("cc")
    if compiler is None:
        logger.warning("MEA's CPU decode: no C compiler (cc, or CC) - the torch path serves")
        return None
    if not _SOURCE.exists():  # an install that left the package's C file out
        logger.warning("MEA's CPU decode: %s is missing - the torch path serves", _SOURCE)
        return None
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join((compiler, *_FLAGS)).encode()
                         + _cpu_features()).hexdigest()[:16]
    library = Path(directory) / f"cpu_decode-{key}.so"
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        # Built beside its final name and renamed: processes that build at once (vLLM's
        # workers) each write their own file, and a reader never sees a partial one.
        handle, partial = tempfile.mkstemp(suffix=".so", dir=library.parent)
        os.close(handle)
        try:
            built = subprocess.run([compiler, *_FLAGS, "-o", partial, str(_SOURCE), "-lm"],
                                   capture_output=True, text=True)
        except OSError as error:  # CC names no program
            built = subprocess.CompletedProcess(compiler, 1, "", str(error))
        if built.returncode != 0:
            os.unlink(partial)
            last = (built.stderr.strip().splitlines() or ["(no output)"])[-1]
            logger.warning("MEA's CPU decode: %s could not build %s (%s) - the torch path "
                           "serves", compiler, _SOURCE.name, last)
            return None
        os.replace(partial, library)
    kernel = ctypes.CDLL(str(library))
    kernel.mea_scaled_decode.restype = ctypes.c_int
    pointer, integer = ctypes.c_void_p, ctypes.c_int64
    kernel.mea_scaled_decode.argtypes = [
        pointer, pointer, pointer, integer, pointer, ctypes.c_int, integer, integer, integer,
        pointer, integer, pointer, integer, integer, integer, integer, ctypes.c_float, pointer]
    return kernel


def _cpu_features() -> bytes:
    """This CPU's instruction-set flags (a kernel built for one CPU may fault on another that
    shares the cache directory); the machine name where /proc/cpuinfo is absent."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine().encode()
    flags = next((line for line in info.splitlines() if line.startswith("flags")), "")
    return (platform.machine() + flags).encode()


def scaled_decode(kernel: ctypes.CDLL, query: torch.Tensor, key_mix: torch.Tensor,
                  value_mix: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                  seq_lens: list, num_scales: int, scale: float) -> torch.Tensor:
    """The decode of the module docstring through the C loop, the heads' mixes in it too.

    Args:
        kernel: `load()`'s library.
        query: `[R, np, hn]` RoPE'd queries, unmixed.
        key_mix: `[np, nc]` `A_k` of each head's group (`prefill.GroupMix.key_per_head`).
        value_mix: `[np, nc]` `A_v` of each head's group.
        kv_cache: `[blocks, 1, bs, C]` rows `[K | r | V]`, a dtype of `ROW_KINDS`, rows contiguous.
        block_table: `[R, max_blocks]` block ids of each request.
        seq_lens: `[R]` positions each request has cached (its new token included), ints >= 1.
        num_scales: `ng`.
        scale: softmax scale.

    Returns:
        `[R, np, hn]` the composite heads' outputs `o_h`, in the query's dtype.
    """
    requests, heads, head_dim = query.shape
    components = key_mix.shape[1]
    width = components * head_dim
    if kv_cache.shape[-1] != 2 * width + num_scales:
        raise ValueError(f"cache rows of {kv_cache.shape[-1]} values do not hold 2 x {width} + "
                         f"{num_scales}")
    if min(seq_lens) < 1 or max(seq_lens) > block_table.shape[1] * kv_cache.shape[2]:
        raise ValueError(f"MEA's CPU decode: seq_lens {seq_lens} must be at least 1 and within "
                         f"the block table's {block_table.shape[1]} blocks of "
                         f"{kv_cache.shape[2]} tokens")
    queries = query.to(torch.float32).contiguous()
    key_mix, value_mix = (mix.to(torch.float32).contiguous() for mix in (key_mix, value_mix))
    table = block_table.to(torch.int32).contiguous()
    lengths = torch.tensor(seq_lens, dtype=torch.int32)
    output = torch.empty(requests, heads, head_dim, dtype=torch.float32)
    status = kernel.mea_scaled_decode(
        queries.data_ptr(), key_mix.data_ptr(), value_mix.data_ptr(), components,
        kv_cache.data_ptr(), ROW_KINDS[kv_cache.dtype], kv_cache.stride(0), kv_cache.stride(2),
        kv_cache.shape[2], table.data_ptr(), table.shape[1], lengths.data_ptr(), requests, heads,
        num_scales, width, scale, output.data_ptr())
    if status != 0:
        raise MemoryError("MEA's CPU decode: no memory for a thread's scratch")
    return output.to(query.dtype)
