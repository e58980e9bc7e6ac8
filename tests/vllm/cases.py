"""The exports the vLLM tests serve: one per family and variant that needs its own code path.

Shared by `make_exports` (main venv, megatron-core) and the tests (vLLM venv): plain data only.
"""

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    family: str
    variant: str  # standard / mea / kha
    components: Optional[int] = None  # MEA nc < ng (4 K/V heads): compressed from the baseline
    options: dict = dataclasses.field(default_factory=dict)
    head_dim: int = 32  # 32-256 for vLLM's CPU attention
    context: int = 256  # max_position_embeddings


CASES = (
    Case("llama-baseline", "llama", "standard"),
    # Head size 64, the size at which the scaled-components cache is measured against the baseline.
    Case("qwen3-baseline", "qwen3", "standard", head_dim=64),
    # No k norm: vLLM caches the nc component heads (the mixing moves to the query side).
    Case("llama-mea-nc2", "llama", "mea", 2),
    Case("qwen2-mea-nc2-norm", "qwen2", "mea", 2, {"mea_head_norm": True}),
    Case("mixtral-mea-nc2", "mixtral", "mea", 2),
    # An RMS k norm: the nc components and one scale per composite key and token are cached.
    Case("qwen3-mea-nc2", "qwen3", "mea", 2, head_dim=64),
    Case("qwen3_moe-mea-nc2-norm", "qwen3_moe", "mea", 2, {"mea_head_norm": True}),
    # The k norm before the mix (norm-then-mix): the normed components are cached.
    Case("qwen3-mea-nc2-norm-before-mix", "qwen3", "mea", 2, {"mea_key_norm_before_mix": True},
         head_dim=64),
    # MEA with nc = ng (upcycled: identity mixing, perturbed) and the head norm.
    Case("llama-mea-norm", "llama", "mea", None, {"mea_head_norm": True}),
    # KHA.
    Case("llama-kha-linear", "llama", "kha", None, {"kha_variant": "linear",
                                                     "kha_targets": ["q", "k", "v"]}),
    Case("qwen2-kha-mlp", "qwen2", "kha", None, {"kha_variant": "mlp"}),
    Case("qwen3_moe-kha-mlp", "qwen3_moe", "kha", None, {"kha_variant": "mlp"}),
)
