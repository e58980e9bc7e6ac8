"""Serve exports with vLLM (`LLM`, the plugin found through its entry point), one after the other
in this process, and write a JSON report per export: the greedy tokens of each prompt, the
KV-cache bytes and token slots vLLM allocated, the plugin's warnings, the decode throughput.
With `--rounds N` the prompts are generated N times (a later round finds the earlier rounds'
blocks in vLLM's prefix cache): `tokens` and `cached_tokens` per round.

    python -m tests.vllm._serve OUT.json EXPORT_DIR... --prompts '[[1, 2, 3], [4, 5]]' \
        [--max-tokens 8] [--tp 2] [--decode-tokens 64] [--llm-args '{"block_size": 16}'] \
        [--rounds 2]

Run with VLLM_ENABLE_V1_MULTIPROCESSING=0 (the engine in this process: vLLM is imported once for
all exports). The vLLM engine may spawn processes: everything runs under
`if __name__ == "__main__"`.
"""

import argparse
import json
import logging
import os
import time


def kv_cache_report(worker):
    """(bytes of every KV-cache tensor the worker allocated, token slots they hold)."""
    runner = worker.model_runner
    config = runner.kv_cache_config
    tensors = {}

    def collect(value):
        if isinstance(value, (list, tuple)):
            for item in value:
                collect(item)
        elif value is not None:  # layers that share one tensor count it once
            tensors[(value.data_ptr(), value.numel())] = value

    collect(runner.kv_caches)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    block_size = config.kv_cache_groups[0].kv_cache_spec.block_size
    return total, config.num_blocks * block_size


class Recorder(logging.Handler):
    """Keeps the messages of the plugin's warnings."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def serve(model, prompts, args):
    """The report of one export."""
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    options = dict(tensor_parallel_size=args.tp, enforce_eager=True, dtype="float32",
                   skip_tokenizer_init=True, max_model_len=256, seed=0)
    llm = LLM(model=model, **{**options, **json.loads(args.llm_args)})
    report = {"startup_s": time.perf_counter() - started}
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                            detokenize=False)
    rounds = [llm.generate(prompts, greedy, use_tqdm=False) for _ in range(args.rounds)]
    report["tokens"] = [list(out.outputs[0].token_ids) for out in rounds[0]]
    if args.rounds > 1:
        report["rounds"] = [{"tokens": [list(out.outputs[0].token_ids) for out in outputs],
                             "cached_tokens": [out.num_cached_tokens for out in outputs]}
                            for outputs in rounds]
    report["kv_cache"] = llm.collective_rpc(kv_cache_report)
    if args.decode_tokens:
        timings = []  # after the greedy run above: no warm-up in the timed runs
        for tokens in (1, 1 + args.decode_tokens):
            params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True,
                                    detokenize=False)
            best = float("inf")  # the best of the repeats: other jobs only ever slow a run
            for _ in range(args.timing_repeats):
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                best = min(best, time.perf_counter() - start)
            timings.append(best)
        report["decode_tokens_per_s"] = (
            len(prompts) * args.decode_tokens / (timings[1] - timings[0]))
    llm.llm_engine.engine_core.shutdown()
    del llm
    return report


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("models", nargs="+")
    parser.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--decode-tokens", type=int, default=0,
                        help="also time a decode of this many tokens per prompt")
    parser.add_argument("--timing-repeats", type=int, default=1,
                        help="time each decode this often and keep the fastest")
    parser.add_argument("--llm-args", default="{}", help="JSON of further `LLM` arguments")
    parser.add_argument("--rounds", type=int, default=1, help="generate the prompts this often")
    args = parser.parse_args(argv)
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    recorder = Recorder()
    logging.getLogger("megatron_mea").addHandler(recorder)
    prompts = [{"prompt_token_ids": ids} for ids in json.loads(args.prompts)]
    reports = {}
    for model in args.models:
        recorder.messages.clear()
        reports[os.path.basename(os.path.normpath(model))] = report = serve(model, prompts, args)
        report["warnings"] = list(recorder.messages)
        cleanup_dist_env_and_memory()
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(reports, handle)


if __name__ == "__main__":
    main()
