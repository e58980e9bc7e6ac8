"""vLLM's OpenAI-compatible server, started as users of the CPU build start it, answers a real
HTTP client (the `openai` package) with the Hugging Face model's greedy tokens, for completions
and chat: MEA `nc = ng/2` with the component cache (Llama) and with the scaled-components cache
(Qwen3's RMS k norm), and KHA.

One server per export, all started side by side once for the module: a start is three Python
processes importing vLLM one after the other, on one core (about 65 s alone on an idle 2-core
machine; the three together took 260 s on a heavily loaded one). Run by `make test-vllm` like
the rest of `tests/vllm/`.
"""

import pytest

from tests.vllm._openai_server import OpenAIServer, serve_copy, word
from tests.vllm.test_vllm_serving import ENV, MAX_TOKENS, PROMPTS, export_dir, hf_greedy

EXPORTS = ("llama-mea-nc2", "qwen3-mea-nc2", "llama-kha-linear")
# The server runs its engine in processes of its own, as users run it.
SERVER_ENV = {k: v for k, v in ENV.items() if k not in (
    "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_ALLOW_INSECURE_SERIALIZATION")}
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
            started[name] = OpenAIServer(model, str(work / "server.log"), SERVER_ENV)
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
