"""`mea-model-size`: parameters, training FLOPs per token and KV-cache bytes per token of a GPT.

Takes the same flags as `pretrain_gpt_mea.py` (Megatron-LM's plus the plugin's), so a launch
script's argument set can be sized directly:

    mea-model-size --num-layers 24 --hidden-size 1408 --num-attention-heads 32 \\
        --group-query-attention --num-query-groups 4 --kv-channels 128 --swiglu \\
        --num-experts 128 --moe-router-topk 8 --moe-ffn-hidden-size 416 --qk-layernorm \\
        --normalization RMSNorm --untie-embeddings-and-output-weights --seq-length 8192 \\
        --vocab-size 128256 --attention-variant mea --mea-num-kv-components 2

The arithmetic (and what is counted) is documented in `megatron_mea/model_size.py`.
"""

import argparse
import json
import sys

from megatron_mea.integrations.args import add_mea_args
from megatron_mea.integrations.dry_run import DEFAULT_VOCAB_SIZE, padded_vocab_size
from megatron_mea.integrations.mlm_flags import build_parser
from megatron_mea.model_size import ModelShape, model_size


def parse_args(argv=None) -> argparse.Namespace:
    """Megatron-LM's and the plugin's flags, plus this tool's.

    Args:
        argv: the arguments. Default: `sys.argv[1:]`.

    Returns:
        The namespace, with `seq_length` and `padded_vocab_size` filled in.
    """
    parser = add_mea_args(build_parser())
    parser.prog = "mea-model-size"
    parser.description = __doc__.split("\n")[0]
    tool = parser.add_argument_group("mea-model-size")
    tool.add_argument("--kv-bytes-per-element", type=int, default=2,
                      help="KV-cache element size: 2 (bf16) or 1 (fp8). Default: 2")
    tool.add_argument("--default-vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                      help=f"vocabulary when --vocab-size is absent. Default: {DEFAULT_VOCAB_SIZE}")
    tool.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    if args.seq_length is None:
        args.seq_length = args.max_position_embeddings or 4096
    args.padded_vocab_size = padded_vocab_size(args, args.default_vocab_size)
    return args


def main(argv=None) -> int:
    """Print the sizes of the model the flags describe (a table, or JSON with `--json`).

    Args:
        argv: the arguments. Default: `sys.argv[1:]`.

    Returns:
        The exit status (0; argparse exits with 2 on usage errors).
    """
    args = parse_args(argv)
    shape = ModelShape.from_args(args)
    size = model_size(shape, bytes_per_element=args.kv_bytes_per_element)
    if args.json:
        print(json.dumps(size, indent=1))
        return 0
    print(f"variant: {shape.attention_variant} (KV heads stored: {shape.kv_heads_stored})")
    print(f"total parameters:       {size['total_params']:>16,d}  "
          f"({size['total_params'] / 1e9:.3f}B)")
    print(f"active parameters:      {size['active_params']:>16,d}  "
          f"({size['active_params'] / 1e9:.3f}B)")
    if size["position_embedding_params"]:
        # Megatron-LM's default; a RoPE model (Llama, Qwen, the papers' models) names it.
        print(f"  of which learned positions: {size['position_embedding_params']:,d} "
              f"(--position-embedding-type {shape.position_embedding_type}; "
              "RoPE has no parameters)")
    print(f"training FLOPs / token: {size['training_flops_per_token']:>16,d}")
    print(f"KV-cache bytes / token: {size['kv_cache_bytes_per_token']:>16,d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
