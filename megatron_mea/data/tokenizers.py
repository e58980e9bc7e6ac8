"""Tokenizers for pretraining data: a byte-level one that needs no files, and a local HF wrapper.

Both implement the interface Megatron-Core's `GPTDataset` duck-types against: `vocab_size`, `eod`
(document separator, used for masks and loss masking), `pad` (optional: when it raises, Megatron
pads with -1, an id that never occurs in data), plus `tokenize` / `detokenize` and
`unique_identifiers` (what identifies the tokenizer in logs and cache names). They subclass no
Megatron class: the tokenizer base classes moved between Megatron-Core releases
(`datasets.megatron_tokenizer` in 0.16, `tokenizers` from 0.17), while the duck-typed interface did not.
"""

import json
import logging
import os
from collections import OrderedDict

logger = logging.getLogger(__name__)

# Names follow Megatron-LM's `--tokenizer-type` choices.
TOKENIZER_TYPES = ("ByteLevelTokenizer", "HuggingFaceTokenizer")


class _Tokenizer:
    """What the tokenizers share: identification by class, paths and options.

    Args:
        *paths: files or directories the tokenizer was loaded from.
        **options: settings that change its output (recorded as strings).
    """

    def __init__(self, *paths: str, **options) -> None:
        self.unique_identifiers = OrderedDict(
            [("class", type(self).__name__), ("tokenizer_path", list(paths))]
        )
        for name, value in options.items():
            self.unique_identifiers[name] = str(value)
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)
        self._vocab, self._inv_vocab = {}, {}

    def _set_vocab(self, vocab: dict) -> None:
        """Set `vocab` (token text to id) and `inv_vocab` (its inverse)."""
        self._vocab = vocab
        self._inv_vocab = {i: t for t, i in vocab.items()}

    @property
    def vocab(self) -> dict:
        """Token text to id."""
        return self._vocab

    @property
    def inv_vocab(self) -> dict:
        """Id to token text."""
        return self._inv_vocab

    @property
    def pad(self) -> int:
        """No pad token by default: Megatron's datasets then pad with -1 and mask it out."""
        raise NotImplementedError(f"{type(self).__name__} has no pad token")


def _bytes_to_unicode() -> dict:
    """GPT-2's printable stand-in character of every byte (what HF's ByteLevel pre-tokenizer
    emits), `{byte: char}`."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1))
                 + list(range(ord("\u00ae"), ord("\u00ff") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


class ByteLevelTokenizer(_Tokenizer):
    """UTF-8 bytes as tokens: ids 0..255 are the bytes, id 256 is the end-of-document token.

    Needs no model file, so it works anywhere. `pad` is deliberately not defined: Megatron's
    datasets then pad with -1 and mask it out, instead of colliding with `eod`.

    Example::

        tok = ByteLevelTokenizer()
        tok.tokenize("h\u00e9")      # [104, 195, 169]
        tok.detokenize([104, 195, 169, tok.eod])  # "h\u00e9" (eod is a separator, not text)
    """

    NUM_BYTES = 256
    EOD = 256
    EOD_TEXT = "<eod>"

    def __init__(self) -> None:
        super().__init__()
        # Byte b is named chr(b) (its Latin-1 reading), so every byte has a distinct one-char name;
        # eod is "<eod>".
        self._set_vocab({**{chr(b): b for b in range(self.NUM_BYTES)}, self.EOD_TEXT: self.EOD})

    def tokenize(self, text: str) -> list[int]:
        """Encode `text` as its UTF-8 bytes.

        Args:
            text: the text.

        Returns:
            One id in [0, 256) per UTF-8 byte; no eod is added.

        Raises:
            UnicodeEncodeError: if `text` holds a lone surrogate (e.g. from a JSON "\\ud800"), which
                has no UTF-8 encoding; callers report it rather than have it silently replaced.
        """
        return list(text.encode("utf-8"))

    def detokenize(self, ids) -> str:
        """Decode ids back to text; eod tokens are dropped, invalid UTF-8 becomes U+FFFD.

        Args:
            ids: iterable of ints in [0, 257).

        Raises:
            ValueError: if an id is outside the vocabulary.
        """
        data = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < self.NUM_BYTES:
                data.append(i)
            elif i != self.EOD:
                raise ValueError(f"token id {i} is outside the byte-level vocabulary [0, 257)")
        return data.decode("utf-8", errors="replace")

    @property
    def vocab_size(self) -> int:
        """257: the 256 byte values plus eod."""
        return self.NUM_BYTES + 1

    @property
    def eod(self) -> int:
        """The end-of-document id, 256."""
        return self.EOD

    def save_hf(self, directory: str) -> None:
        """Write the equal HF tokenizer into `directory` (what an HF export of a byte-level run
        carries): UTF-8 byte `b` is id `b`, `<eod>` (id 256) the end-of-sequence token."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {char: b for b, char in _bytes_to_unicode().items()}
        vocab[self.EOD_TEXT] = self.EOD
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tokenizer.decoder = decoders.ByteLevel()
        fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=self.EOD_TEXT)
        fast.add_special_tokens({"eos_token": self.EOD_TEXT})
        fast.save_pretrained(directory)


class HuggingFaceTokenizer(_Tokenizer):
    """A `transformers.AutoTokenizer` loaded from a local directory, never from the Hub.

    Mirrors Megatron-LM's `_HuggingFaceTokenizer`: `eod` is the tokenizer's eos token, `vocab_size`
    is `len(tokenizer)` (added tokens included), and `tokenize` lets the tokenizer add its special
    tokens (e.g. a BOS) unless `add_special_tokens=False`.

    Args:
        model_dir: directory holding the tokenizer files (tokenizer.json, tokenizer_config.json...).
        add_special_tokens: passed to the tokenizer on every `tokenize` call. Default: True.
        trust_remote_code: passed to `from_pretrained`. Default: False.

    Raises:
        ImportError: if transformers is not installed (the `megatron_mea[hf]` extra).
        ValueError: if `model_dir` is not an existing directory.
    """

    def __init__(
        self, model_dir: str, add_special_tokens: bool = True, trust_remote_code: bool = False
    ) -> None:
        try:
            import transformers
        except ImportError as err:
            raise ImportError(
                "HuggingFaceTokenizer needs transformers, which is not installed: "
                "pip install 'megatron_mea[hf]'"
            ) from err
        if not os.path.isdir(model_dir):
            raise ValueError(
                f"--tokenizer-model {model_dir!r} is not a local directory; HuggingFaceTokenizer "
                "loads tokenizer files from disk only and never downloads from the Hub"
            )
        super().__init__(
            model_dir, add_special_tokens=add_special_tokens, trust_remote_code=trust_remote_code
        )
        self.model_dir = model_dir
        self._add_special_tokens = add_special_tokens
        self._tokenizer = transformers.AutoTokenizer.from_pretrained(
            model_dir, local_files_only=True, trust_remote_code=trust_remote_code
        )
        self._set_vocab(self._tokenizer.get_vocab())  # added tokens included

    def tokenize(self, text: str) -> list[int]:
        """Encode `text` to token ids (special tokens as configured; no eod appended)."""
        return self._tokenizer(text, add_special_tokens=self._add_special_tokens).input_ids

    def detokenize(self, ids) -> str:
        """Decode token ids to text."""
        return self._tokenizer.decode([int(i) for i in ids])

    @property
    def vocab_size(self) -> int:
        """`len(tokenizer)`: the base vocabulary plus added tokens."""
        return len(self._tokenizer)

    @property
    def eod(self) -> int:
        """The eos token id, used as the document separator.

        Raises:
            NotImplementedError: if the tokenizer defines no eos token.
        """
        if self._tokenizer.eos_token_id is None:
            raise NotImplementedError(
                f"the tokenizer in {self.model_dir} defines no eos token, which megatron_mea uses "
                "as the end-of-document token"
            )
        return self._tokenizer.eos_token_id

    @property
    def pad(self) -> int:
        """The pad token id.

        Raises:
            NotImplementedError: if the tokenizer has none (Megatron then pads with -1).
        """
        if self._tokenizer.pad_token_id is None:
            raise NotImplementedError(f"the tokenizer in {self.model_dir} defines no pad token")
        return self._tokenizer.pad_token_id

    @property
    def bos(self) -> int:
        """The bos token id (None if the tokenizer has none)."""
        return self._tokenizer.bos_token_id


def build_tokenizer(tokenizer_type: str, tokenizer_model: str | None = None):
    """Build a tokenizer from Megatron-LM style `--tokenizer-type` / `--tokenizer-model` values.

    Args:
        tokenizer_type: "ByteLevelTokenizer" or "HuggingFaceTokenizer".
        tokenizer_model: local tokenizer directory; required for HuggingFaceTokenizer, ignored
            (with a warning) for ByteLevelTokenizer. Default: None.

    Returns:
        ByteLevelTokenizer | HuggingFaceTokenizer.

    Raises:
        ValueError: for an unknown type or a missing `tokenizer_model`.
    """
    if tokenizer_type == "ByteLevelTokenizer":
        if tokenizer_model is not None:
            logger.warning(
                "--tokenizer-model %r is ignored: ByteLevelTokenizer needs no model",
                tokenizer_model,
            )
        return ByteLevelTokenizer()
    if tokenizer_type == "HuggingFaceTokenizer":
        if not tokenizer_model:
            raise ValueError(
                "--tokenizer-model (a local tokenizer directory) is required with "
                "--tokenizer-type HuggingFaceTokenizer"
            )
        return HuggingFaceTokenizer(tokenizer_model)
    raise ValueError(
        f"unknown --tokenizer-type {tokenizer_type!r}; choose one of {', '.join(TOKENIZER_TYPES)}"
    )
