"""`mea-generate`: text from a `mea-pretrain` checkpoint, with a KV cache, at any TP size.

    mea-generate --load runs/mea --prompt "Once upon a time" --max-new-tokens 64
    torchrun --nproc-per-node 2 --no-python mea-generate --load runs/mea --tp 2 \
        --prompt-file prompts.txt --temperature 0.8 --top-p 0.9 --batch-size 8

Prompts come from `--prompt` (repeatable) and `--prompt-file` (one per line). Greedy decoding by
default; `--temperature`, `--top-k`, `--top-p` sample. With a batch of one prompt the text is
streamed as it is generated. The report gives tokens/s and the KV-cache bytes (MEA with virtual
heads caches only its component heads). The logic lives in `megatron_mea.inference`.
"""

import argparse
import logging
import os
import sys

from megatron_mea.cpu import megatron_on_cpu
from megatron_mea.runtime.argparsing import ArgumentParser


def build_parser() -> argparse.ArgumentParser:
    """The command-line flags."""
    parser = ArgumentParser(prog="mea-generate", description=__doc__.split("\n")[0])
    parser.add_argument("--load", required=True,
                        help="run directory (with config.yaml) or one of its iter_XXXXXXX folders")
    parser.add_argument("--iteration", "--ckpt-step", dest="iteration", type=int,
                        help="checkpoint iteration. Default: latest")
    parser.add_argument("--tp", type=int, default=int(os.environ.get("WORLD_SIZE", "1")),
                        help="tensor-parallel size. Default: the world size")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    parser.add_argument("--prompt-file", help="a file of prompts, one per line")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy. Default: 0")
    parser.add_argument("--top-k", type=int, default=0, help="0 disables. Default: 0")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 disables. Default: 1")
    parser.add_argument("--seed", type=int, default=1234, help="sampling seed")
    parser.add_argument("--batch-size", type=int, default=1, help="prompts decoded together")
    parser.add_argument("--ignore-eod", action="store_true", help="do not stop at end-of-document")
    parser.add_argument("--no-stream", action="store_true", help="print each text when complete")
    return parser


def _prompts(args) -> list:
    prompts = list(args.prompt)
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as handle:
            prompts += [line.rstrip("\n") for line in handle if line.strip()]
    return prompts


def _warn_past_trained_length(prog, loaded, prompts, max_new_tokens) -> None:
    """One line on stderr where a prompt and its new tokens go past the sequence length the
    model was trained at (RoPE extrapolates, but what it gives there was never trained)."""
    trained = loaded.args.seq_length
    lengths = [len(loaded.tokenizer.tokenize(p)) + max_new_tokens for p in prompts]
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    if lengths[longest] > trained:
        print(f"{prog}: warning: prompt {longest} ({lengths[longest] - max_new_tokens} tokens) "
              f"+ --max-new-tokens {max_new_tokens} exceeds the sequence length the model was "
              f"trained at ({trained})", file=sys.stderr)


@megatron_on_cpu()
def main(argv=None) -> int:
    """Load the checkpoint, generate, print the texts and the statistics.

    Args:
        argv: the arguments. Default: `sys.argv[1:]`.

    Returns:
        The exit status: 0 done; 2 refused input (usage, or a checkpoint that is missing,
        corrupt, unsafe or cannot be loaded at this TP size: one line); 1 a failure at run time.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    prompts = _prompts(args)
    if not prompts:
        parser.error("give at least one --prompt or a --prompt-file")
    empty = [index for index, prompt in enumerate(prompts) if not prompt]
    if empty:
        parser.error(f"prompt {empty[0]} is empty: a prompt needs at least one token")
    logging.basicConfig(level=logging.WARNING)
    import torch.distributed as dist

    from megatron_mea.inference import (
        SamplingParams,
        TextStream,
        generate,
        load_for_inference,
    )
    from megatron_mea.checkpoint.errors import CheckpointError

    try:
        sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    except ValueError as exc:
        parser.error(str(exc))
    try:  # a missing or broken checkpoint, or a TP size the model cannot be split into
        loaded = load_for_inference(args.load, args.tp, iteration=args.iteration)
    except (FileNotFoundError, CheckpointError, ValueError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    _warn_past_trained_length(parser.prog, loaded, prompts, args.max_new_tokens)
    speak = dist.get_rank() == 0
    stream = speak and args.batch_size == 1 and not args.no_stream
    current = {}  # the prompt being streamed: its index and TextStream

    def on_token(index, token):
        if current.get("index") != index:
            if current:
                print(current["stream"].flush())
            current.update(index=index, stream=TextStream(loaded.tokenizer))
            print(f"[{index}] {prompts[index]}", end="", flush=True)
        print(current["stream"].push(token), end="", flush=True)

    out = generate(
        loaded.model, loaded.tokenizer, prompts, args.max_new_tokens, sampling,
        stop_at_eod=not args.ignore_eod, max_batch_size=args.batch_size,
        on_token=on_token if stream else None,
    )
    if not speak:
        return 0
    if stream:
        print(current["stream"].flush())
    else:
        for index, (prompt, text) in enumerate(zip(prompts, out.texts)):
            print(f"[{index}] {prompt}{text}")
    stats, config = out.stats, loaded.model.config
    cached = (config.mea_num_kv_components if config.attention_variant == "mea"
              else config.num_query_groups)
    print(f"checkpoint: {loaded.checkpoint} (attention_variant={config.attention_variant}, "
          f"{cached} cached K/V heads per layer, TP={args.tp})")
    print(f"generated {stats.generated_tokens} tokens from {stats.prompt_tokens} prompt tokens in "
          f"{stats.prefill_seconds + stats.decode_seconds:.3f} s: "
          f"{stats.tokens_per_second:.1f} tokens/s "
          f"(decode {stats.decode_tokens_per_second:.1f} tokens/s)")
    print(f"KV cache: {stats.kv_cache_bytes_total} bytes ({stats.kv_cache_bytes} per TP rank)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
