"""MEA's component caches served by vLLM: a Qwen3 export (RMS q/k norm, `nc = ng/2`: the
scaled-components cache, `integrations/vllm/scaled_cache.py`) and a Llama one (the plain
component cache, `components_cpu.py`) served through vLLM's paged cache (chunked prefill,
requests of different lengths in one batch, a second round from the prefix cache) generate the
Hugging Face model's greedy tokens. The attention itself is checked against attention over the
composite heads in `test_vllm_component_paths.py`.
"""

import pytest

from tests.vllm.test_vllm_serving import hf_greedy, serve

# Long prompts sharing a 40-token prefix and one short prompt: 16 tokens per step split every
# prompt into chunks and mix decodes of one request with prefill chunks of another (vLLM's CPU
# kernel, which the plain component cache uses, takes blocks of 32 tokens).
PREFIX = [(7 * i + 3) % 128 for i in range(40)]
PAGED_PROMPTS = [PREFIX + [5, 17, 33, 2, 90], PREFIX + [100, 3, 3, 47, 120, 8, 77, 21, 9, 54],
                 [42, 11, 64], [(11 * i + 5) % 128 for i in range(70)]]
PAGED_ENGINE = {"block_size": 32, "max_num_batched_tokens": 16, "max_num_seqs": 4,
                "enable_chunked_prefill": True, "enable_prefix_caching": True}
# Both component layouts: scaled (Qwen3's k norm after the mix) and plain (Llama).
PAGED_EXPORTS = ("qwen3-mea-nc2", "llama-mea-nc2")


@pytest.fixture(scope="module")
def served_paged(tmp_path_factory):
    return serve(PAGED_EXPORTS, tmp_path_factory.mktemp("vllm") / "paged.json",
                 prompts=PAGED_PROMPTS, llm_args=PAGED_ENGINE, rounds=2)


@pytest.mark.parametrize("name", PAGED_EXPORTS)
def test_component_caches_chunked_and_prefix_cached_give_hf_tokens(served_paged, name):
    want = hf_greedy(name, PAGED_PROMPTS)
    first, second = served_paged[name]["rounds"]
    assert first["tokens"] == want
    assert second["tokens"] == want
    # The second round read the shared block from the prefix cache.
    assert all(count >= 32 for count in second["cached_tokens"][:2]), second["cached_tokens"]
