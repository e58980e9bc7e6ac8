"""Checkpoint formats and conversions.

Pure tensor helpers (no parallel state): `fuse_qkv` / `unfuse_qkv` (Megatron's interleaved
`linear_qkv` layout), `fold_head_mix` / `fold_kha_linear`.

Conversions (imported lazily, they need transformers / safetensors where noted):
- `import_hf_checkpoint`: Hugging Face safetensors -> `torch_dist` checkpoint of `mea-pretrain`
  (baseline, MEA or KHA upcycling).
- `export_hf_checkpoint`: `torch_dist` -> Hugging Face (plain family architecture with folding,
  or `megatron_mea.hf` modeling code).
- `compress_checkpoint`, `probe_layers`, `select_layers`, `load_tokens`: MEA post-hoc KV
  compression and its per-layer probe.
`mea-convert` (`megatron_mea.cli.convert`) is the command line over them. Outputs go to a new
or empty directory, written under a temporary name and renamed at the end (`output_dir`).
"""

from megatron_mea.checkpoint.fold import fold_head_mix, fold_kha_linear
from megatron_mea.ops.qkv_layout import fuse_qkv, unfuse_qkv

_LAZY = {
    "import_hf_checkpoint": "hf_import",
    "export_hf_checkpoint": "hf_export",
    "compress_checkpoint": "compress",
    "probe_layers": "compress",
    "select_layers": "compress",
    "load_tokens": "compress",
    "ConversionError": "megatron_io",
    "ModelDescription": "megatron_io",
    "read_checkpoint": "dist_io",
    "write_checkpoint": "dist_io",
    "load_model_weights": "megatron_io",
}

__all__ = ["fold_head_mix", "fold_kha_linear", "fuse_qkv", "unfuse_qkv", *_LAZY]


def __getattr__(name):
    # The conversions import Megatron's model stack (and transformers for HF); keep
    # `import megatron_mea.checkpoint` as light as the tensor helpers.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"megatron_mea.checkpoint.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
