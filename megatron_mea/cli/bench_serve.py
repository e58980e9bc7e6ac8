"""`mea-bench-serve`: MEA `nc = ng/2` served by vLLM's OpenAI server against its original, under
memory pressure, in paired rounds of concurrent requests.

    mea-bench-serve --out runs/bench_serve --vllm-python .venv-vllm/bin/python   # main venv
    mea-bench-serve --shapes hd64 --rounds 6 --vllm-bench ...
    mea-bench-serve --shapes hd128 --output-tokens 256 ...                     # decode-heavier
    mea-bench-serve --pair ORIGINAL_EXPORT MEA_EXPORT --shapes tiny ...         # your exports

Per shape (`megatron_mea.apps.bench.serve_exports.SHAPES`; default `hd128`: hidden 1024 = 8 heads x
128, 4 layers, 4 K/V groups, 1024+64-token requests) and family (Llama: component cache; Qwen3,
k norm after the mix: scaled components) the exports are made once under `OUT/exports` by
`--exports-python` (Megatron-Core), both servers are started side by side by `--vllm-python`
with one `--kv-cache-memory-bytes` pool that holds `--fit-requests` of the original's requests
(MEA `nc = ng/2` holds about twice as many), and the rounds alternate: original, MEA, original,
MEA, ... each offering the same `--num-requests` fresh random prompts at once. Reported per
export, median over the rounds: output tokens per server CPU-second (psutil over the server's
process tree) and per wall second, running requests (max and mean of `/metrics` samples),
engine steps, preemptions; KV tokens from `/metrics`; the MEA / original ratios. Server logs go
to `OUT/logs/`; `OUT/report.json`, `OUT/report.md` and (with matplotlib) `OUT/report.png`.
"""

import signal
import sys

from megatron_mea.apps.bench import serve_exports
from megatron_mea.apps.bench.serve import ServeError, run
from megatron_mea.runtime.argparsing import ArgumentParser
from megatron_mea.runtime.console import print_progress


def build_parser():
    parser = ArgumentParser(prog="mea-bench-serve", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/bench_serve", help="exports, logs and report")
    parser.add_argument("--shapes", nargs="+", default=["hd128"],
                        choices=sorted(serve_exports.SHAPES))
    parser.add_argument("--families", nargs="+", default=list(serve_exports.FAMILIES),
                        choices=serve_exports.FAMILIES)
    parser.add_argument("--pair", nargs=2, metavar=("ORIGINAL", "MEA"),
                        help="serve these two exports instead of making the shape's")
    parser.add_argument("--num-requests", type=int, default=16, help="concurrent per round")
    parser.add_argument("--rounds", type=int, default=6, help="paired rounds")
    parser.add_argument("--prompt-tokens", type=int, help="default: the shape's")
    parser.add_argument("--output-tokens", type=int, help="default: the shape's")
    parser.add_argument("--fit-requests", type=float, default=4.25,
                        help="requests of the original the KV pool holds. Default: 4.25")
    parser.add_argument("--vllm-bench", action="store_true",
                        help="also run vLLM's own client (random dataset) once per export")
    parser.add_argument("--vllm-python", default=sys.executable,
                        help="the interpreter with vLLM. Default: this one")
    parser.add_argument("--exports-python", default=sys.executable,
                        help="the interpreter with Megatron-Core that makes the exports")
    return parser


def _exit_on_sigterm(signum, frame):
    """SIGTERM (`kill PID`, SLURM, `timeout`) unwinds as Ctrl-C does: the servers are stopped on
    the way out, instead of left running without the tool that started them."""
    raise SystemExit(128 + signum)


def main(argv=None) -> int:
    """Serve every case, print the table, write the report.

    Args:
        argv: the arguments. Default: `sys.argv[1:]`.

    Returns:
        The exit status: 0, or 1 when the exports could not be made (one line naming the log).
        SIGTERM exits with 143 once the servers have stopped, as the signal's default would.
    """
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    print_progress("megatron_mea.apps.bench.serve")
    try:
        run(args)
    except ServeError as exc:
        print(f"mea-bench-serve: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
