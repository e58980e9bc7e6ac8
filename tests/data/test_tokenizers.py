"""Tokenizers: byte-level round trip, the Megatron interface GPTDataset relies on, the factory."""

import json
import logging

import pytest

from megatron_mea.data.tokenizers import ByteLevelTokenizer, HuggingFaceTokenizer, build_tokenizer

TEXTS = ["", "hello", "caf\u00e9 \u00fc\u00df \u4e2d\u6587 \U0001f600", "tab\tnew\nline\r\n\x00"]


@pytest.mark.parametrize("text", TEXTS, ids=["empty", "ascii", "non-ascii", "control"])
def test_byte_tokenizer_round_trips_utf8(text):
    tok = ByteLevelTokenizer()
    ids = tok.tokenize(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.detokenize(ids + [tok.eod]) == text


def test_byte_tokenizer_special_ids_and_vocab():
    tok = ByteLevelTokenizer()
    assert tok.vocab_size == 257 and tok.eod == 256
    assert len(tok.vocab) == 257 and tok.inv_vocab[256] == "<eod>"
    assert all(tok.vocab[tok.inv_vocab[i]] == i for i in range(257))
    # No pad: Megatron's datasets then pad with -1 instead of colliding with eod.
    with pytest.raises(NotImplementedError):
        _ = tok.pad


def test_byte_tokenizer_decodes_invalid_bytes_with_replacement_and_rejects_bad_ids():
    tok = ByteLevelTokenizer()
    assert tok.detokenize([104, 0xFF, 105]) == "h\ufffdi"
    with pytest.raises(ValueError, match="257"):
        tok.detokenize([257])


def test_byte_tokenizer_rejects_lone_surrogates():
    with pytest.raises(UnicodeEncodeError):
        ByteLevelTokenizer().tokenize("\ud800")


def test_byte_tokenizer_has_megatron_identity_without_deprecation_noise(caplog):
    with caplog.at_level(logging.WARNING):
        tok = ByteLevelTokenizer()
    assert "legacy tokenizer" not in caplog.text
    # GPTDataset hashes this into its cache file names, so it must be JSON-serialisable.
    assert json.loads(json.dumps(tok.unique_identifiers))["class"] == "ByteLevelTokenizer"


def test_build_tokenizer_names_the_flag_on_bad_input(tmp_path):
    assert isinstance(build_tokenizer("ByteLevelTokenizer"), ByteLevelTokenizer)
    with pytest.raises(ValueError, match="--tokenizer-type 'GPT2BPETokenizer'"):
        build_tokenizer("GPT2BPETokenizer")
    with pytest.raises(ValueError, match="--tokenizer-model"):
        build_tokenizer("HuggingFaceTokenizer", None)
    with pytest.raises((ValueError, ImportError), match="tokenizer-model|megatron_mea\\[hf\\]"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "missing"))


def _save_tiny_hf_tokenizer(directory):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"[UNK]": 0, "</s>": 1, "<pad>": 2, "hello": 3, "world": 4}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.decoder = tokenizers.decoders.WordPiece()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(directory)


def test_hf_tokenizer_loads_a_local_directory(tmp_path):
    _save_tiny_hf_tokenizer(tmp_path)
    tok = build_tokenizer("HuggingFaceTokenizer", str(tmp_path))
    assert isinstance(tok, HuggingFaceTokenizer)
    assert tok.tokenize("hello world nope") == [3, 4, 0]
    assert (tok.vocab_size, tok.eod, tok.pad) == (5, 1, 2)
    assert tok.detokenize([3, 4]) == "hello world"
    assert tok.inv_vocab[4] == "world"
