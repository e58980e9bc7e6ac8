"""vLLM's KV capacity and decode speed of MEA's three cache layouts against the baseline, in one
run (a benchmark that prints, not a timed test):

    .venv/bin/python -m tests.vllm.bench_kv_cache make DIR          # the exports (main venv)
    .venv-vllm/bin/python -m tests.vllm.bench_kv_cache run DIR \\
        [--context 2048] [--decode-tokens 64] [--num-prompts 4] [--json OUT]

Exports (tiny random models through the package's own conversion path, `make_exports`; 8 query
/ 4 K/V heads of 64, 2 layers): per family the baseline, MEA `nc = ng` (upcycled: composite
heads cached), MEA `nc = ng/2` (compressed): the `nc` components for Llama (no k norm), the
components plus one scale per composite key for Qwen3 (RMS q/k norm). Each is served by vLLM
(`tests.vllm._serve`, fp32, eager, `VLLM_CPU_KVCACHE_SPACE` GiB of cache) with `--num-prompts`
prompts of `--context` tokens; the table gives the tokens vLLM's pool holds (what it logs as
"KV cache size") and decode tokens/s of the prompts decoded together (the time of generating
`1 + --decode-tokens` tokens less that of 1 token, each the best of 3), each against the
family's baseline.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

from tests.vllm.cases import Case

CONTEXT = 4096
_SIZES = dict(head_dim=64, context=CONTEXT)
# (case, cache layout the plugin chooses)
BENCH = (
    (Case("bench-llama-baseline", "llama", "standard", **_SIZES), "baseline"),
    (Case("bench-llama-mea", "llama", "mea", **_SIZES), "composites"),
    (Case("bench-llama-mea-nc2", "llama", "mea", 2, **_SIZES), "components"),
    (Case("bench-qwen3-baseline", "qwen3", "standard", **_SIZES), "baseline"),
    (Case("bench-qwen3-mea", "qwen3", "mea", **_SIZES), "composites"),
    (Case("bench-qwen3-mea-nc2", "qwen3", "mea", 2, **_SIZES), "scaled components"),
)
ENV = dict(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", HF_HUB_OFFLINE="1",
           TOKENIZERS_PARALLELISM="false", VLLM_ENABLE_V1_MULTIPROCESSING="0",
           VLLM_ALLOW_INSECURE_SERIALIZATION="1")


def make(root):
    """Write the exports of `BENCH` under `root` (main venv: Megatron-Core converts)."""
    from megatron_mea.checkpoint.torch_dist.model_only import converter_process
    from megatron_mea.cpu import megatron_on_cpu
    from megatron_mea.runtime.quiet import quiet_warnings
    from tests.vllm.make_exports import build_case

    quiet_warnings()
    with megatron_on_cpu(), converter_process():
        for case, _ in BENCH:
            print(f"[bench_kv_cache] {build_case(case, root)}", flush=True)


def run(root, context, decode_tokens, num_prompts):
    """{case name: `_serve` report} of every export served with the same prompts."""
    prompts = [[(7 * i + 13 * p + 1) % 128 for i in range(context)] for p in range(num_prompts)]
    llm_args = {"max_model_len": context + decode_tokens + 8}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench.json")
        command = [sys.executable, "-m", "tests.vllm._serve", out,
                   *[os.path.join(root, case.name) for case, _ in BENCH],
                   "--prompts", json.dumps(prompts), "--max-tokens", "1",
                   "--decode-tokens", str(decode_tokens), "--timing-repeats", "3",
                   "--llm-args", json.dumps(llm_args)]
        done = subprocess.run(command, env={**os.environ, **ENV}, capture_output=True,
                              text=True)
        if done.returncode != 0:
            sys.exit(f"bench_kv_cache: error: vLLM failed (exit {done.returncode}):\n"
                     f"{done.stderr[-4000:]}")
        with open(out, encoding="utf-8") as handle:
            return json.load(handle)


def table(reports):
    """Rows of the printed table, each layout against its family's baseline."""
    rows = ["| family | cached | KV tokens (vLLM) | vs baseline | decode tok/s | vs baseline |",
            "|---|---|---|---|---|---|"]
    baseline = {}
    for case, layout in BENCH:
        report = reports[case.name]
        tokens = sum(slots for _, slots in report["kv_cache"])
        speed = report["decode_tokens_per_s"]
        if layout == "baseline":
            baseline[case.family] = (tokens, speed)
        base_tokens, base_speed = baseline[case.family]
        rows.append(f"| {case.family} | {layout} | {tokens:,} | {tokens / base_tokens:.2f}x "
                    f"| {speed:.1f} | {speed / base_speed:.2f}x |")
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=("make", "run"))
    parser.add_argument("root", help="directory of the exports")
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--json", help="also write the reports here")
    args = parser.parse_args(argv)
    if args.step == "make":
        make(args.root)
        return 0
    if args.context + args.decode_tokens + 8 > CONTEXT:
        parser.error(f"--context ({args.context}) plus --decode-tokens ({args.decode_tokens}) "
                     f"must stay below the exports' {CONTEXT} positions")
    reports = run(args.root, args.context, args.decode_tokens, args.num_prompts)
    print(f"context {args.context}, {args.num_prompts} prompts decoded together, "
          f"{args.decode_tokens} tokens each")
    print("\n".join(table(reports)))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(reports, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
