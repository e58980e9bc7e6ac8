"""`mea-bench-serve` stopped by SIGTERM to its own process (`kill PID`: what a scheduler or a user
sends to the tool alone) stops the vLLM servers it started, engine processes included, and exits
with 143. Before, the servers outlived it. The signal comes once both servers have spawned their
engine processes, so each has its whole process tree to shut down.
"""

import os
import signal
import subprocess
import sys
import time

import psutil

from tests.vllm.test_vllm_serving import export_dir

STARTUP_S = 300  # two servers importing vLLM side by side on a shared 2-core machine


def _engines_started(tool: psutil.Process) -> bool:
    """Whether the tool's two servers each have a child (vLLM's engine core) yet."""
    try:
        servers = [child for child in tool.children()
                   if "vllm.entrypoints.openai.api_server" in " ".join(child.cmdline())]
        return len(servers) == 2 and all(server.children() for server in servers)
    except psutil.NoSuchProcess:  # a process of the tree ended while it was read
        return False


def test_sigterm_to_the_tool_stops_its_servers(tmp_path):
    out = tmp_path / "bench"
    command = [sys.executable, "-m", "megatron_mea.cli.bench_serve", "--out", str(out),
               "--shapes", "tiny", "--pair", export_dir("llama-baseline"),
               export_dir("llama-mea-nc2"), "--num-requests", "2", "--rounds", "1",
               "--vllm-python", sys.executable]
    with open(tmp_path / "console.log", "w", encoding="utf-8") as console:
        tool = subprocess.Popen(command, stdout=console, stderr=subprocess.STDOUT)
    started = []
    try:
        tree = psutil.Process(tool.pid)
        deadline = time.monotonic() + STARTUP_S
        while not _engines_started(tree):
            assert tool.poll() is None, (tmp_path / "console.log").read_text()
            assert time.monotonic() < deadline, "the servers' engines did not start"
            time.sleep(0.5)
        started = tree.children(recursive=True)

        os.kill(tool.pid, signal.SIGTERM)

        assert tool.wait(timeout=150) == 128 + signal.SIGTERM
        _, alive = psutil.wait_procs(started, timeout=30)
        assert not alive, [" ".join(process.cmdline()[:3]) for process in alive]
    finally:  # a failed check leaves nothing running
        if tool.poll() is None:
            tool.kill()
        for process in started:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
