"""Generation with a KV cache for the baseline, MEA (component heads cached) and KHA.

    from megatron_mea.inference import load_for_inference, generate, SamplingParams

    loaded = load_for_inference("runs/mea", tp=2)          # every TP rank calls it
    out = generate(loaded.model, loaded.tokenizer, ["Once upon"], max_new_tokens=32,
                   sampling=SamplingParams(temperature=0.8, top_p=0.9))
    out.texts[0], out.stats.tokens_per_second, out.stats.kv_cache_bytes_total
"""

from megatron_mea.inference.generate import (
    GenerationOutput,
    GenerationStats,
    forward_step,
    generate,
    kv_cache_bytes,
)
from megatron_mea.inference.loading import (
    InferenceModel,
    load_for_inference,
    load_model,
    find_run_checkpoint,
)
from megatron_mea.inference.sampling import SamplingParams, sample_next_tokens
from megatron_mea.inference.streaming import TextStream

__all__ = [
    "GenerationOutput",
    "GenerationStats",
    "InferenceModel",
    "SamplingParams",
    "TextStream",
    "forward_step",
    "generate",
    "kv_cache_bytes",
    "load_for_inference",
    "load_model",
    "find_run_checkpoint",
    "sample_next_tokens",
]
