"""`mea-soak`'s episodes: a small MoE GPT with MEA trained twice on several processes (torchrun,
gloo on CPU), once uninterrupted and once SIGKILLed at random moments and resumed with `--load`,
the two compared step by step (`megatron_mea.cli.soak` says what passes). Episode lines are INFO
records of this module's logger.
"""

import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import psutil

logger = logging.getLogger(__name__)

MODEL = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--num-query-groups", "2", "--seq-length", "64", "--num-experts", "4",
    "--moe-ffn-hidden-size", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--mock-data", "--eval-interval", "100000", "--log-interval", "100000", "--no-progress-bar",
    "--attention-variant", "mea", "--lr", "3e-3", "--min-lr", "3e-4",
]


def launch(world_size, argv, log):
    """torchrun in a new session, so the whole group can be killed at once."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world_size),
               "--master-port", str(random.randint(20000, 40000)),
               "-m", "megatron_mea.cli.pretrain", *argv]
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def kill_tree(process):
    """SIGKILL torchrun and its workers (torchrun puts each worker in a session of its own, so
    killing its process group would leave the workers running); returns the pids of helper
    processes (the workers' children, e.g. checkpoint writers) still alive 10 s later: they must
    die with their trainer. Survivors are then killed too."""
    agent = psutil.Process(process.pid)
    workers = agent.children()
    helpers = [p for w in workers for p in w.children(recursive=True)]
    os.killpg(process.pid, signal.SIGKILL)
    for worker in workers:
        try:
            worker.kill()
        except psutil.NoSuchProcess:
            pass
    process.wait()
    psutil.wait_procs(workers, timeout=30)
    _, alive = psutil.wait_procs(helpers, timeout=10)
    for survivor in alive:
        try:
            survivor.kill()
        except psutil.NoSuchProcess:
            pass
    return [p.pid for p in alive]


def losses(save_dir):
    """iteration -> loss, the last record of each iteration winning (redone steps overwrite)."""
    result = {}
    with open(os.path.join(save_dir, "metrics.jsonl"), encoding="utf-8") as handle:
        for line in handle:
            record = json.loads(line)
            result[record["iteration"]] = record["lm loss"]
    return result


def episode(workdir, args, rng, log):
    """One reference run and one killed-and-resumed run; returns (kills, problems)."""
    common = [*MODEL, "--train-iters", str(args.iters), "--save-interval", str(args.save_interval),
              "--seed", str(rng.randint(1, 10**6)), *args.parallel]
    reference_dir, soak_dir = os.path.join(workdir, "reference"), os.path.join(workdir, "soak")
    if launch(args.world_size, [*common, "--save", reference_dir], log).wait() != 0:
        return 0, ["reference run failed"]
    kills = 0
    while True:
        # Until the first checkpoint there is nothing to load: a fresh start, asked for.
        process = launch(args.world_size, [*common, "--save", soak_dir, "--load", soak_dir,
                                           "--no-exit-on-missing-checkpoint"], log)
        try:
            code = process.wait(timeout=rng.uniform(args.kill_min, args.kill_max))
            if code != 0:
                return kills, [f"run exited with {code}"]
            break
        except subprocess.TimeoutExpired:
            survivors = kill_tree(process)
            if survivors:
                return kills, [f"processes {survivors} outlived their killed trainer"]
            kills += 1
    expected, got = losses(reference_dir), losses(soak_dir)
    problems = [f"iteration {i} lost" for i in range(1, args.iters + 1) if i not in got]
    problems += [f"iteration {i}: {got[i]} != {expected[i]}" for i in expected
                 if i in got and got[i] != expected[i]]
    return kills, problems


def run(args) -> int:
    """Run episodes (`episode`) until `args.minutes` have passed, logging one line each and the
    totals; returns the number of episodes that failed (their logs are kept)."""
    rng = random.Random(args.seed)
    deadline = time.time() + 60 * args.minutes
    total_kills, episodes, failures = 0, 0, 0
    while time.time() < deadline:
        workdir = tempfile.mkdtemp(prefix="mea-soak-")
        with open(os.path.join(workdir, "log.txt"), "w") as log:
            kills, problems = episode(workdir, args, rng, log)
        episodes += 1
        total_kills += kills
        status = "ok" if not problems else "FAILED: " + "; ".join(problems[:5])
        logger.info("episode %d: %d iterations, %d kills -> %s", episodes, args.iters, kills,
                    status)
        if problems:
            failures += 1
            logger.info("  logs kept in %s", workdir)
        else:
            shutil.rmtree(workdir)
    logger.info("%d episodes, %d SIGKILLs, %d failed (%.0f s budget)", episodes, total_kills,
                failures, 60 * args.minutes)
    return failures
