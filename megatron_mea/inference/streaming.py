"""Turn a stream of generated token ids into printable text increments."""

REPLACEMENT = "\ufffd"


class TextStream:
    """Incremental detokenization for streamed output.

    A token may be part of a multi-byte character (byte-level tokenizers) or change how the
    previous tokens decode (BPE), so each push decodes the whole continuation and returns only
    the new text, holding back a trailing U+FFFD that may still become a character.

    Args:
        tokenizer: anything with `detokenize(ids) -> str`.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids = []
        self.emitted = 0

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self.ids.append(token_id)
        text = self.tokenizer.detokenize(self.ids)
        end = len(text.rstrip(REPLACEMENT))
        if end <= self.emitted:
            return ""
        new, self.emitted = text[self.emitted : end], end
        return new

    def flush(self) -> str:
        """The text not yet returned (incomplete characters included, as U+FFFD)."""
        text = self.tokenizer.detokenize(self.ids)
        new, self.emitted = text[self.emitted :], len(text)
        return new
