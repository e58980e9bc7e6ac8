"""Incremental decoding with the KV cache equals the full forward, for every variant (TP=1)."""

import pytest
import torch
from megatron.core.inference.contexts import StaticInferenceContext

from megatron_mea.inference import (
    SamplingParams,
    TextStream,
    generate,
    sample_next_tokens,
)
from megatron_mea.layers.kv_cache import CacheKind
from tests._models import build_gpt, perturb_plugin_params, tiny_config
from tests.inference._common import (
    NEW_TOKENS,
    PROMPTS,
    VARIANTS,
    IdTokenizer,
    full_forward_logits,
    kv_cache_bytes_expected,
)


def _model(fields):
    model = build_gpt(tiny_config(**fields))
    perturb_plugin_params(model)
    return model


@pytest.mark.parametrize("fields", [f for _, f in VARIANTS], ids=[n for n, _ in VARIANTS])
def test_incremental_decoding_equals_full_forward_at_every_step(single_rank, fields):
    model = _model(fields)
    out = generate(model, IdTokenizer(), PROMPTS, NEW_TOKENS, stop_at_eod=False,
                   return_logits=True)
    assert [len(t) for t in out.tokens] == [NEW_TOKENS] * len(PROMPTS)
    reference = full_forward_logits(model, PROMPTS, out.tokens)
    for got, want in zip(out.logits, reference):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # Greedy: each token is the argmax of its logits over the real vocabulary.
    for got, tokens in zip(out.logits, out.tokens):
        assert got[:, : IdTokenizer.vocab_size].argmax(-1).tolist() == tokens


def test_virtual_heads_cache_half_the_baseline_bytes_plus_the_key_scales(single_rank):
    sizes, kinds = {}, {}
    for name, fields in VARIANTS:
        model = _model(fields)
        kinds[name] = {m.cache_kind for m in model.modules() if hasattr(m, "cache_kind")}
        out = generate(model, IdTokenizer(), PROMPTS, NEW_TOKENS, stop_at_eod=False)
        sizes[name] = out.stats.kv_cache_bytes
        assert out.stats.kv_cache_bytes_total == out.stats.kv_cache_bytes
        assert sizes[name] == kv_cache_bytes_expected(name), name
    # 2 layers x (K, V) x max_seq 14 x batch 3 x 4 heads x hn 8 x 4 bytes.
    assert sizes["baseline"] == 2 * 2 * 14 * 3 * 4 * 8 * 4
    assert sizes["mea"] == sizes["kha"] == sizes["baseline"]
    assert 2 * sizes["mea-half-no-qk-norm"] == sizes["baseline"]
    # With the k norm: one fp32 scalar per composite head (4) and token, beside 2 x 2 x 8 values.
    assert sizes["mea-half"] == sizes["baseline"] // 2 + 2 * 14 * 3 * 4 * 4
    assert kinds["mea"] == {CacheKind.COMPOSITES}  # nc == ng
    assert kinds["mea-half-no-qk-norm"] == {CacheKind.COMPONENTS}
    assert kinds["mea-half"] == {CacheKind.SCALED_COMPONENTS}
    assert 2 * sizes["mea-half-norm-before-mix"] == sizes["baseline"]
    assert kinds["mea-half-norm-before-mix"] == {CacheKind.COMPONENTS}


def _all_logits(context):
    # Every position's logits, not the last one's (the flag moved to `context.config` in 0.17).
    config = getattr(context, "config", None)
    owner = config if hasattr(config, "materialize_only_last_token_logits") else context
    owner.materialize_only_last_token_logits = False


@pytest.mark.parametrize("fields", [VARIANTS[1][1], VARIANTS[2][1], VARIANTS[6][1]],
                         ids=["mea", "mea-half", "mea-half-no-qk-norm"])
def test_multi_token_steps_with_or_without_a_mask_equal_the_full_forward(single_rank, fields):
    # Decode steps of 3 tokens after a 4-token prefill: the new tokens attend causally among
    # themselves; an explicit mask (as Megatron's static engine passes) gives the same logits.
    model = _model(fields).eval()
    tokens = torch.tensor([PROMPTS[1] + [7, 9, 13, 21]])
    width = tokens.shape[1]
    with torch.no_grad():
        reference = model(tokens, torch.arange(width)[None], None, runtime_gather_output=True)[0]
    for explicit_mask in (False, True):
        context = StaticInferenceContext(max_batch_size=1, max_sequence_length=width)
        _all_logits(context)
        chunks = []
        for start, end in ((0, 4), (4, 7), (7, 10), (10, 12)):
            mask = None
            if explicit_mask:
                mask = torch.ones(end - start, end, dtype=torch.bool).triu(start + 1)[None, None]
            with torch.no_grad():
                chunks.append(model(tokens[:, start:end], torch.arange(start, end)[None], mask,
                                    inference_context=context, runtime_gather_output=True)[0])
            context.increment_sequence_len_offset(end - start)
        torch.testing.assert_close(torch.cat(chunks), reference, atol=1e-5, rtol=1e-5)


def test_key_norm_that_does_not_factor_caches_the_composites(single_rank):
    # A LayerNorm k norm (mean and bias) does not commute with the mix: the layer falls back to
    # caching the composite heads, still exact, at the baseline's size.
    fields = dict(VARIANTS[2][1], normalization="LayerNorm")
    model = _model(fields)
    kinds = {m.cache_kind for m in model.modules() if hasattr(m, "cache_kind")}
    assert kinds == {CacheKind.COMPOSITES}
    out = generate(model, IdTokenizer(), PROMPTS, NEW_TOKENS, stop_at_eod=False,
                   return_logits=True)
    for got, want in zip(out.logits, full_forward_logits(model, PROMPTS, out.tokens)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert out.stats.kv_cache_bytes == kv_cache_bytes_expected("baseline")


def test_batching_and_eod_stop_do_not_change_the_tokens(single_rank):
    model = _model(VARIANTS[2][1])
    whole = generate(model, IdTokenizer(), PROMPTS, NEW_TOKENS, stop_at_eod=False)
    one_by_one = generate(model, IdTokenizer(), PROMPTS, NEW_TOKENS, stop_at_eod=False,
                          max_batch_size=1)
    assert one_by_one.tokens == whole.tokens

    class StopAtThird(IdTokenizer):
        eod = whole.tokens[0][2]

    streamed = []
    stopped = generate(model, StopAtThird(), PROMPTS, NEW_TOKENS,
                       on_token=lambda i, t: streamed.append((i, t)))
    stop = StopAtThird.eod
    assert stopped.tokens[0] == whole.tokens[0][: whole.tokens[0].index(stop) + 1]
    for i, tokens in enumerate(stopped.tokens):
        assert [t for j, t in streamed if j == i] == tokens
        assert whole.tokens[i][: len(tokens)] == tokens
        assert tokens[-1] == stop or len(tokens) == NEW_TOKENS


def test_sampling_is_seeded_and_respects_top_k_and_top_p(single_rank):
    model = _model(VARIANTS[1][1])
    params = SamplingParams(temperature=1.0, top_k=5, seed=3)
    first = generate(model, IdTokenizer(), PROMPTS, NEW_TOKENS, params, stop_at_eod=False)
    again = generate(model, IdTokenizer(), PROMPTS, NEW_TOKENS, params, stop_at_eod=False)
    assert first.tokens == again.tokens

    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]]).repeat(2000, 1)
    gen = torch.Generator().manual_seed(0)
    top2 = sample_next_tokens(logits, SamplingParams(temperature=1.0, top_k=2), gen)
    assert set(top2.tolist()) == {0, 1}
    # p(0) = 0.64, p(0) + p(1) = 0.88: top_p 0.8 keeps exactly the first two.
    nucleus = sample_next_tokens(logits, SamplingParams(temperature=1.0, top_p=0.8), gen)
    assert set(nucleus.tolist()) == {0, 1}
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_text_stream_holds_back_incomplete_characters():
    from megatron_mea.data import ByteLevelTokenizer

    tokenizer = ByteLevelTokenizer()
    stream = TextStream(tokenizer)
    pieces = [stream.push(t) for t in tokenizer.tokenize("a\u00e9b")]
    assert pieces == ["a", "", "\u00e9", "b"]
    assert stream.flush() == ""
