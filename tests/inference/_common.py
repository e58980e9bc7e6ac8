"""Shared pieces of the inference tests: the variants, a token-id tokenizer, the reference."""

import torch

from tests._models import VOCAB

NO_QK_NORM = dict(qk_layernorm=False)
# With qk_layernorm, MEA-half caches the RoPE'd components and one scalar per composite key and
# token (the k norm's inverse RMS); without it, the components only. MEA (nc = ng) caches the
# composites, like the baseline.
VARIANTS = [
    ("baseline", dict(variant="standard")),
    ("mea", dict(variant="mea", mea_mix_init="normal")),
    ("mea-half", dict(variant="mea", mea_num_kv_components=2, mea_mix_init="normal")),
    ("kha", dict(variant="kha", kha_variant="linear")),
    ("baseline-no-qk-norm", dict(variant="standard", **NO_QK_NORM)),
    ("mea-no-qk-norm", dict(variant="mea", mea_mix_init="normal", **NO_QK_NORM)),
    ("mea-half-no-qk-norm",
     dict(variant="mea", mea_num_kv_components=2, mea_mix_init="normal", **NO_QK_NORM)),
    # The k norm before HLC: the normed components are cached, no key scales.
    ("mea-half-norm-before-mix", dict(variant="mea", mea_num_kv_components=2,
                                      mea_mix_init="normal", mea_key_norm_before_mix=True)),
    # The +norm control (head norm, no HLC): nc == ng, the composites are cached.
    ("mea-norm", dict(variant="mea", mea_hlc=False)),
]

# Different lengths: rows keep consuming their prompt while others already generate.
PROMPTS = [[5, 17, 33, 2, 60], [71, 8, 8, 40, 3, 19, 90, 11], [44, 1, 29]]
NEW_TOKENS = 6
MAX_SEQ = max(len(p) for p in PROMPTS) + NEW_TOKENS  # the static context `generate` allocates
HEAD_DIM, GROUPS, LAYERS = 8, 4, 2  # tiny_config's


def kv_cache_bytes_expected(name, tp=1, rank_only=False):
    """Bytes of `generate`'s static cache for `PROMPTS` (fp32): K and V of the cached heads, plus
    the per-composite-key scalars of MEA-half with qk_layernorm."""
    heads = 2 if name.startswith("mea-half") else GROUPS
    scales = GROUPS if name == "mea-half" else 0
    per_token = 2 * heads * HEAD_DIM + scales
    if rank_only:
        per_token //= tp
    return LAYERS * MAX_SEQ * len(PROMPTS) * per_token * 4


class IdTokenizer:
    """Token ids are the text: the smallest tokenizer `generate` accepts.

    Args:
        vocab_size: ids it knows. Default: the class's `vocab_size`.
    """

    vocab_size = VOCAB - 5  # the last ids play the padded-vocabulary rows: never generated
    eod = 0

    def __init__(self, vocab_size=None):
        if vocab_size is not None:
            self.vocab_size = vocab_size

    def tokenize(self, text):
        return [int(t) for t in text.split()]

    def detokenize(self, ids):
        return " ".join(str(i) for i in ids)


def full_forward_logits(model, prompts, generated):
    """Logits of the full (no cache) forward at the positions that chose each generated token:
    one `[n_i, V]` tensor per prompt."""
    rows = [p + g for p, g in zip(prompts, generated)]
    width = max(len(r) for r in rows)
    tokens = torch.tensor([r + [0] * (width - len(r)) for r in rows])  # causal: padding is inert
    positions = torch.arange(width).expand_as(tokens)
    model.eval()  # as generate does (MoE refuses training-mode TP without SP)
    with torch.no_grad():
        logits = model(tokens, positions, None, runtime_gather_output=True)
    return [
        logits[i, len(p) - 1 : len(p) - 1 + len(g)]
        for i, (p, g) in enumerate(zip(prompts, generated))
    ]
