"""Text generation on Megatron-Core's static inference context (a preallocated KV cache).

The cache holds what each attention layer stores: the K/V groups for the baseline and KHA; for
MEA with virtual heads (`nc < ng`) the `nc` RoPE'd component heads plus, with qk_layernorm, one
scalar per composite head and token, and each step attends over them directly with the mix on
the query side (`megatron_mea/layers/kv_cache.py`, docs/inference-decode.md). With `nc = ng/2`
the cache is half the baseline's K/V plus those scalars. Megatron's dynamic (paged) context
needs flash-attn and is not supported by MEA (its layer raises NotImplementedError).

Prompts of different lengths share one batch the way Megatron's static engine does it: the
prefill covers the shortest prompt, then one position per step; a row whose prompt is not yet
consumed is fed its own prompt token, so every row sees exactly its own sequence, unpadded.

Shape legend: `b` prompts in a batch, `s` positions, `V` padded vocabulary.
"""

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core.inference.contexts import StaticInferenceContext

from megatron_mea.compat import materialize_only_last_token_logits
from megatron_mea.inference.sampling import SamplingParams, sample_next_tokens

logger = logging.getLogger(__name__)

TokenCallback = Callable[[int, int], None]


@dataclass
class GenerationStats:
    """Counters and timings of one `generate` call.

    Attributes:
        prompt_tokens: tokens in all prompts.
        generated_tokens: tokens produced (all prompts, eod included).
        prefill_seconds: time in the prompt forwards (first token of each batch included).
        decode_seconds: time in the one-position decode steps (forward and sampling).
        decode_rows: batch rows processed by decode steps (`b` per step).
        kv_cache_bytes: bytes of the largest KV cache allocated on this rank.
        kv_cache_bytes_total: the same summed over the tensor-parallel group.
    """

    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_rows: int = 0
    kv_cache_bytes: int = 0
    kv_cache_bytes_total: int = 0

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second of wall time (prefill and decode)."""
        seconds = self.prefill_seconds + self.decode_seconds
        return self.generated_tokens / seconds if seconds > 0 else float("nan")

    @property
    def decode_tokens_per_second(self) -> float:
        """Decode throughput: batch rows advanced by one token per second of decode time."""
        return self.decode_rows / self.decode_seconds if self.decode_seconds > 0 else float("nan")


@dataclass
class GenerationOutput:
    """What `generate` returns, one entry per prompt in the order given.

    Attributes:
        prompt_tokens: the prompts' token ids.
        tokens: the generated token ids (ending with eod when generation stopped there).
        texts: the generated text (`tokenizer.detokenize(tokens)`).
        logits: with `return_logits`, `[n_i, V]` fp32 logits (on CPU) each generated token was
            chosen from, before the padded vocabulary rows were masked; else None.
        stats: counters, timings and KV-cache bytes.
    """

    prompt_tokens: list[list[int]]
    tokens: list[list[int]]
    texts: list[str]
    logits: list[torch.Tensor] | None = None
    stats: GenerationStats = field(default_factory=GenerationStats)


def kv_cache_bytes(context: StaticInferenceContext, group=None) -> int:
    """Bytes of the K and V buffers allocated in a static inference context.

    Args:
        context: a context that has run at least one forward (buffers are allocated lazily).
        group: a process group to sum over (e.g. the TP group for the whole model's cache).
            Default: None (this rank only).
    """
    local = sum(
        buffer.numel() * buffer.element_size()
        for buffers in context.key_value_memory_dict.values()
        for buffer in buffers
    )
    if group is None or dist.get_world_size(group) == 1:
        return local
    total = torch.tensor([local], dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        total = total.cuda()
    dist.all_reduce(total, group=group)
    return int(total.item())


def _unwrap(model):
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        model = model.module
    return model


def _tp_group(model):
    pg_collection = getattr(_unwrap(model), "pg_collection", None)
    if pg_collection is not None and hasattr(pg_collection, "tp"):
        return pg_collection.tp
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def forward_step(model, tokens: torch.Tensor, start: int, context) -> torch.Tensor:
    """Run positions `[start, start + s)` through the model with the KV cache of `context`.

    The caller advances `context.sequence_len_offset` afterwards (Megatron's static protocol).

    Args:
        model: a GPTModel (first and last pipeline stage), in eval mode.
        tokens: `[b, s]` token ids at those positions.
        start: position of the first token (= `context.sequence_len_offset`).
        context: a `StaticInferenceContext`.

    Returns:
        logits of the last position `[b, V]` (gathered over TP), or of every position `[b, s, V]`
        when `context.materialize_only_last_token_logits` is False.
    """
    b, s = tokens.shape
    position_ids = torch.arange(start, start + s, device=tokens.device).expand(b, s)
    logits = model(
        tokens, position_ids, None, inference_context=context, runtime_gather_output=True
    )
    return logits[:, -1, :] if materialize_only_last_token_logits(context) else logits


def generate(
    model,
    tokenizer,
    prompts: Sequence[str | Sequence[int]],
    max_new_tokens: int,
    sampling: SamplingParams | None = None,
    *,
    stop_at_eod: bool = True,
    max_batch_size: int | None = None,
    on_token: TokenCallback | None = None,
    return_logits: bool = False,
) -> GenerationOutput:
    """Generate continuations of `prompts` with a KV cache (Megatron's static context).

    Every tensor-parallel rank must call it with the same arguments; the chosen tokens are
    broadcast from TP rank 0, so ranks never diverge. Pipeline parallelism is not supported.

    Args:
        model: a GPTModel (or a wrapper with `.module`), TP-sharded or not; put in eval mode for
            the call.
        tokenizer: a `megatron_mea.data` tokenizer (`tokenize`, `detokenize`, `vocab_size`, `eod`).
        prompts: texts, or token-id lists; each at least one token.
        max_new_tokens: tokens to generate per prompt (fewer when eod comes first).
        sampling: how tokens are chosen. Default: greedy.
        stop_at_eod: stop a prompt's generation after it produces `tokenizer.eod`. Default: True.
        max_batch_size: prompts decoded together (one KV cache). Default: all of them.
        on_token: called as `on_token(prompt_index, token_id)` for every generated token, as soon
            as it is chosen (on every rank). Default: None.
        return_logits: keep the logits of every generated token. Default: False.

    Returns:
        A `GenerationOutput`.

    Raises:
        ValueError: for an empty prompt, `max_new_tokens < 1`, a model that is not a whole
            pipeline, or a sequence longer than learned absolute position embeddings allow.
    """
    sampling = sampling or SamplingParams()
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens ({max_new_tokens}) must be >= 1")
    prompt_ids = [
        list(tokenizer.tokenize(p)) if isinstance(p, str) else [int(t) for t in p] for p in prompts
    ]
    for index, ids in enumerate(prompt_ids):
        if not ids:
            raise ValueError(f"prompt {index} is empty: at least one token is needed")
    inner = _unwrap(model)
    if not (getattr(inner, "pre_process", True) and getattr(inner, "post_process", True)):
        raise ValueError("generate needs the whole model on each rank (pipeline parallel size 1)")
    longest = max(len(ids) for ids in prompt_ids) + max_new_tokens
    learned = getattr(inner, "position_embedding_type", None) == "learned_absolute"
    if learned and longest > inner.max_sequence_length:
        raise ValueError(
            f"prompt + max_new_tokens ({longest}) exceeds the model's learned position "
            f"embeddings ({inner.max_sequence_length})"
        )

    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(sampling.seed)
    tp_group = _tp_group(model)
    batch_size = max_batch_size or len(prompt_ids)
    out = GenerationOutput(prompt_ids, [], [], [] if return_logits else None)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for first in range(0, len(prompt_ids), batch_size):
                batch = _Batch(
                    model, prompt_ids[first : first + batch_size], first, max_new_tokens,
                    sampling, generator, tokenizer, stop_at_eod, on_token, return_logits,
                    tp_group, device, out.stats,
                )
                batch.run()
                out.tokens.extend(batch.new_tokens)
                if return_logits:
                    out.logits.extend(torch.stack(rows) for rows in batch.logits)
    finally:
        model.train(was_training)
    out.texts = [tokenizer.detokenize(ids) for ids in out.tokens]
    out.stats.prompt_tokens = sum(len(ids) for ids in prompt_ids)
    out.stats.generated_tokens = sum(len(ids) for ids in out.tokens)
    return out


class _Batch:
    """The decoding of one batch of prompts with its own static KV cache."""

    def __init__(
        self, model, prompts, first_index, max_new_tokens, sampling, generator, tokenizer,
        stop_at_eod, on_token, return_logits, tp_group, device, stats,
    ):
        self.model, self.prompts, self.first_index = model, prompts, first_index
        self.max_new_tokens, self.sampling, self.generator = max_new_tokens, sampling, generator
        self.vocab_size, self.eod = tokenizer.vocab_size, tokenizer.eod if stop_at_eod else None
        self.on_token, self.return_logits = on_token, return_logits
        self.tp_group, self.device, self.stats = tp_group, device, stats
        self.lengths = [len(ids) for ids in prompts]
        self.new_tokens = [[] for _ in prompts]
        self.logits = [[] for _ in prompts]
        self.done = [False] * len(prompts)

    def run(self) -> None:
        """Prefill the shortest prompt, then decode one position per step until every row is
        done."""
        b, total = len(self.prompts), max(self.lengths) + self.max_new_tokens
        tokens = torch.zeros(b, total, dtype=torch.long, device=self.device)
        for row, ids in enumerate(self.prompts):
            tokens[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        lengths = torch.tensor(self.lengths, device=self.device)
        context = StaticInferenceContext(max_batch_size=b, max_sequence_length=total)

        start = time.perf_counter()
        pos = min(self.lengths)
        logits = forward_step(self.model, tokens[:, :pos], 0, context)
        context.increment_sequence_len_offset(pos)
        context.enable_decode_mode()
        pos -= 1  # `logits` predict position pos + 1
        self._choose(tokens, lengths, pos, logits)
        _sync(self.device)
        self.stats.prefill_seconds += time.perf_counter() - start

        start = time.perf_counter()
        while not all(self.done):
            pos += 1
            logits = forward_step(self.model, tokens[:, pos : pos + 1], pos, context)
            context.increment_sequence_len_offset(1)
            self._choose(tokens, lengths, pos, logits)
            self.stats.decode_rows += b
        _sync(self.device)
        self.stats.decode_seconds += time.perf_counter() - start
        self.stats.kv_cache_bytes = max(self.stats.kv_cache_bytes, kv_cache_bytes(context))
        self.stats.kv_cache_bytes_total = max(
            self.stats.kv_cache_bytes_total, kv_cache_bytes(context, self.tp_group)
        )

    def _choose(self, tokens, lengths, pos, logits) -> None:
        """Pick the token at `pos + 1` for the rows past their prompt; record and report it."""
        masked = logits.float().clone()
        masked[:, self.vocab_size :] = float("-inf")  # padded vocabulary rows are not tokens
        chosen = sample_next_tokens(masked, self.sampling, self.generator)
        if dist.is_initialized() and dist.get_world_size(self.tp_group) > 1:
            # Ranks hold identical gathered logits; the broadcast makes agreement a guarantee.
            dist.broadcast(chosen, dist.get_global_rank(self.tp_group, 0), group=self.tp_group)
        generating = lengths <= pos + 1
        tokens[:, pos + 1] = torch.where(generating, chosen, tokens[:, pos + 1])
        for row, token in enumerate(chosen.tolist()):
            if self.done[row] or pos + 1 < self.lengths[row]:
                continue
            self.new_tokens[row].append(token)
            if self.return_logits:
                self.logits[row].append(logits[row].float().cpu())
            if self.on_token is not None:
                self.on_token(self.first_index + row, token)
            if token == self.eod or len(self.new_tokens[row]) == self.max_new_tokens:
                self.done[row] = True
