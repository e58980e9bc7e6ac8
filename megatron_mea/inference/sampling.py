"""Next-token selection: greedy, temperature, top-k and top-p (nucleus) sampling.

Pure torch on gathered logits `[b, V]`; no megatron imports.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen from the logits.

    Args:
        temperature: softmax temperature; 0 selects greedy decoding (argmax). Default: 0.0.
        top_k: keep only the `top_k` most likely tokens; 0 keeps all. Default: 0.
        top_p: keep the smallest set of most likely tokens whose probability reaches `top_p`;
            1.0 keeps all. Default: 1.0.
        seed: seed of the sampling generator (the same on every rank, so TP ranks agree).
            Default: 1234.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 1234

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature ({self.temperature}) must be >= 0 (0 is greedy)")
        if self.top_k < 0:
            raise ValueError(f"top_k ({self.top_k}) must be >= 0 (0 disables it)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p ({self.top_p}) must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        """Whether the choice is the argmax (temperature 0 or top_k 1)."""
        return self.temperature == 0.0 or self.top_k == 1


def sample_next_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Choose one token per row.

    Args:
        logits: `[b, V]` (any float dtype; filtered and sampled in fp32).
        params: the sampling settings.
        generator: random generator on `logits.device` (ignored when greedy).

    Returns:
        token ids `[b]` (int64).
    """
    if params.greedy:
        return logits.argmax(dim=-1)
    logits = logits.float() / params.temperature
    if params.top_k > 0:
        k = min(params.top_k, logits.shape[-1])
        kth = torch.topk(logits, k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p (the top one stays).
        drop_sorted = torch.cumsum(probs, dim=-1) - probs >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
