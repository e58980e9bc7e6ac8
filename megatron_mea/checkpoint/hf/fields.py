"""Hugging Face config fields <-> the model description's (`RunArgs`) fields, declared once.

`CARRIED` is the one table of the correspondence: export (`config.hf_config_dict`) writes each
entry's HF fields from the description, import (`config.description_from_hf`) reads the entry's
`RunArgs` fields back from an HF config; the two directions of an entry stand side by side.
Every field of a supported family's transformers config class is in one of:
- `CARRIED`: it carries `RunArgs` fields;
- `FIXED`: the value the Megatron model here always has (export writes it, import refuses
  another, naming the field);
- `NOT_MODEL`: it says nothing of the model's function or of its training (kept as the
  template has it).
`NOT_CARRIED` names the model and training fields of `ModelArgs` that no family's config has
(an import gives them their defaults, and an export names the training settings among them that
are not at their defaults: `settings_left_out`; the variant's fields travel in native configs
only).
`tests/checkpoint/test_hf_fields.py` holds the tables against the transformers classes and
round-trips every carried field of every family.
"""

import inspect
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from megatron_mea.checkpoint.errors import ConversionError
from megatron_mea.model.args import MODEL_FIELDS, RunArgs, declared, moe_layers_of_freq

DENSE = ("llama", "qwen2", "qwen3")
MOE = ("qwen3_moe", "mixtral")

# Megatron-Core's llama3 RoPE scaling takes only `factor`; the other parameters are the
# defaults of `RotaryEmbedding._apply_scaling` (read there, so a release that changes them is
# followed): low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192.
_SCALING = inspect.signature(RotaryEmbedding._apply_scaling).parameters
LLAMA3_FIXED = dict(
    low_freq_factor=float(_SCALING["low_freq_factor"].default),
    high_freq_factor=float(_SCALING["high_freq_factor"].default),
    original_max_position_embeddings=_SCALING["original_max_position_embeddings"].default,
)


@dataclass(frozen=True)
class Carried:
    """HF fields `hf` <-> `RunArgs` fields `run`, in `families` (None: every family).

    Attributes:
        to_hf: export: `(args, moe_layers) -> {hf field: value}`; `args` has every derived size
            filled in (`ModelDescription.resolved`), `moe_layers` is per layer whether it is MoE.
        to_run: import: `(hf_config) -> {RunArgs field: value}` (a transformers config object).
    """

    hf: Tuple[str, ...]
    run: Tuple[str, ...]
    to_hf: Callable[[RunArgs, Tuple[bool, ...]], Dict]
    to_run: Callable[[object], Dict]
    families: Optional[Tuple[str, ...]] = None


def _copy(hf: str, run: str, families=None) -> Carried:
    return Carried((hf,), (run,), lambda args, _: {hf: getattr(args, run)},
                   lambda config: {run: getattr(config, hf)}, families)


def _negated(hf: str, run: str, families=None) -> Carried:
    return Carried((hf,), (run,), lambda args, _: {hf: not getattr(args, run)},
                   lambda config: {run: not getattr(config, hf)}, families)


def rope_settings(config) -> Tuple[float, Optional[float]]:
    """(rope_theta, llama3 scaling factor or None) of an HF config.

    Raises:
        ConversionError: a RoPE type other than default / llama3, or a llama3 parameter that
            Megatron fixes at another value.
    """
    parameters = getattr(config, "rope_parameters", None)
    if not parameters:  # configs written before transformers 5: separate fields
        parameters = dict(getattr(config, "rope_scaling", None) or {},
                          rope_theta=getattr(config, "rope_theta", 10000.0))
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    theta = float(parameters["rope_theta"])
    if parameters.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConversionError(
            f"rope_parameters.partial_rotary_factor ({parameters['partial_rotary_factor']!r}) is "
            "not supported: mea-pretrain rotates every channel of a head"
        )
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ConversionError(
            f"rope_parameters.rope_type ({rope_type!r}) is not supported: Megatron's RoPE "
            "scales frequencies the llama3 way only"
        )
    for name, fixed in LLAMA3_FIXED.items():
        if parameters.get(name) != fixed:
            raise ConversionError(
                f"rope_parameters.{name} ({parameters.get(name)!r}) is not supported: Megatron's "
                f"llama3 RoPE scaling fixes it at {fixed!r} (only factor is configurable)"
            )
    return theta, float(parameters["factor"])


def _rope_to_hf(args: RunArgs, _) -> Dict:
    theta = float(args.rotary_base)
    if not args.use_rope_scaling:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": theta}}
    return {"rope_parameters": {"rope_type": "llama3", "rope_theta": theta,
                                "factor": args.rope_scaling_factor, **LLAMA3_FIXED}}


def _rope_to_run(config) -> Dict:
    theta, factor = rope_settings(config)
    return dict(
        rotary_base=int(theta) if theta.is_integer() else theta,
        use_rope_scaling=factor is not None,
        rope_scaling_factor=RunArgs.rope_scaling_factor if factor is None else factor,
    )


def moe_layer_pattern(fam_name: str, config) -> List[bool]:
    """Per layer, whether it is an MoE layer (HF's rule for the family)."""
    if fam_name not in MOE:
        return [False] * config.num_hidden_layers
    if fam_name == "qwen3_moe":
        step = getattr(config, "decoder_sparse_step", 1) or 1
        dense = set(getattr(config, "mlp_only_layers", None) or [])
        return [i not in dense and (i + 1) % step == 0 for i in range(config.num_hidden_layers)]
    return [True] * config.num_hidden_layers


def moe_layer_freq_of(pattern: List[bool]):
    """The shortest `moe_layer_freq` of a per-layer MoE pattern: the int N whose rule
    (`moe_layers_of_freq`) gives it, else the 0/1 list."""
    for freq in range(1, len(pattern) + 1):
        if moe_layers_of_freq(freq, len(pattern)) == tuple(pattern):
            return freq
    return [int(moe) for moe in pattern]


def _moe_pattern_to_hf(_, moe_layers: Tuple[bool, ...]) -> Dict:
    # HF's decoder_sparse_step counts from 1 (layer N-1 is its first MoE layer), Megatron's
    # moe_layer_freq from 0: the dense layers are written out one by one instead.
    return {"decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, moe in enumerate(moe_layers) if not moe]}


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


CARRIED: Tuple[Carried, ...] = (
    _copy("vocab_size", "vocab_size"),
    _copy("hidden_size", "hidden_size"),
    _copy("num_hidden_layers", "num_layers"),
    _copy("num_attention_heads", "num_attention_heads"),
    _copy("num_key_value_heads", "num_query_groups"),
    Carried(("head_dim",), ("kv_channels",), lambda args, _: {"head_dim": args.kv_channels},
            lambda config: {"kv_channels": _head_dim(config)}),
    _copy("intermediate_size", "ffn_hidden_size", DENSE + ("qwen3_moe",)),
    # Mixtral's only MLP is the expert's (its dense width is not a parameter of any layer).
    Carried(("intermediate_size",), ("moe_ffn_hidden_size",),
            lambda args, _: {"intermediate_size": args.moe_ffn_hidden_size},
            lambda config: {"moe_ffn_hidden_size": config.intermediate_size,
                            "ffn_hidden_size": config.intermediate_size}, ("mixtral",)),
    _copy("max_position_embeddings", "max_position_embeddings"),
    _copy("rms_norm_eps", "layernorm_epsilon"),
    _negated("tie_word_embeddings", "untie_embeddings_and_output_weights"),
    Carried(("rope_parameters",), ("rotary_base", "use_rope_scaling", "rope_scaling_factor"),
            _rope_to_hf, _rope_to_run),
    _copy("initializer_range", "init_method_std"),
    _copy("attention_dropout", "attention_dropout"),
    Carried(("dtype",), ("bf16",),
            lambda args, _: {"dtype": "bfloat16" if args.bf16 else "float32"},
            lambda config: {"bf16": str(getattr(config, "dtype", None)
                                        or getattr(config, "torch_dtype", None))
                            .endswith("bfloat16")}),
    _copy("num_experts", "num_experts", ("qwen3_moe",)),
    _copy("num_local_experts", "num_experts", ("mixtral",)),
    _copy("moe_intermediate_size", "moe_ffn_hidden_size", ("qwen3_moe",)),
    _copy("num_experts_per_tok", "moe_router_topk", MOE),
    # norm_topk_prob renormalises the top-k probabilities: Megatron's top-k-then-softmax.
    _negated("norm_topk_prob", "moe_router_pre_softmax", ("qwen3_moe",)),
    Carried(("decoder_sparse_step", "mlp_only_layers"), ("moe_layer_freq",), _moe_pattern_to_hf,
            lambda config: {"moe_layer_freq": moe_layer_freq_of(
                moe_layer_pattern("qwen3_moe", config))}, ("qwen3_moe",)),
    # transformers' default is 0.001, Megatron's 0.01: without it a round trip trains the
    # router ten times more weakly.
    _copy("router_aux_loss_coef", "moe_aux_loss_coeff", MOE),
)


@dataclass(frozen=True)
class Fixed:
    """HF field `hf` with the one value (`value`) the Megatron model here computes, in
    `families` (None: every family that has it); `accepts` tells an equivalent value."""

    hf: str
    value: object
    why: str
    families: Optional[Tuple[str, ...]] = None
    accepts: Optional[Callable[[object], bool]] = None

    def refuse(self, config) -> None:
        """Raise ConversionError naming the field when `config` holds another value."""
        if not hasattr(config, self.hf):
            return
        value = getattr(config, self.hf)
        if not (self.accepts(value) if self.accepts else value == self.value):
            raise ConversionError(f"{self.hf} ({value!r}) is not supported: {self.why}")


_NO_SLIDING = "sliding-window attention is not wired through mea-pretrain"
FIXED: Tuple[Fixed, ...] = (
    Fixed("hidden_act", "silu", "Megatron's model here is SwiGLU with SiLU"),
    Fixed("mlp_bias", False, "Megatron's MLPs here have no biases", ("llama",)),
    # Llama's and Qwen3's attention_bias also adds o_proj's; Qwen2 has q/k/v biases only.
    Fixed("attention_bias", False, "only Qwen2's q/k/v biases are supported",
          ("llama", "qwen3", "qwen3_moe")),
    Fixed("use_sliding_window", False, _NO_SLIDING, ("qwen2", "qwen3", "qwen3_moe")),
    Fixed("sliding_window", None, _NO_SLIDING, ("mixtral",), accepts=lambda value: not value),
    Fixed("layer_types", None, _NO_SLIDING, ("qwen2", "qwen3"),
          accepts=lambda value: set(value or ()) <= {"full_attention"}),
    Fixed("router_jitter_noise", 0.0, "mea-pretrain's router adds no input jitter",
          ("mixtral",)),
)

# Fields of the transformers config classes that say nothing of the model's function or its
# training, with why.
NOT_MODEL: Dict[str, str] = {
    "transformers_version": "written by transformers",
    "architectures": "the family's (Family.architecture)",
    "output_hidden_states": "what a forward returns",
    "return_dict": "what a forward returns",
    "output_router_logits": "what a forward returns (and whether HF's own training adds its "
                            "aux loss); published configs leave it false whatever the run's "
                            "moe_router_load_balancing_type",
    "chunk_size_feed_forward": "an inference memory setting",
    "is_encoder_decoder": "false for every causal LM",
    "id2label": "classification heads only",
    "label2id": "classification heads only",
    "problem_type": "classification heads only",
    "use_cache": "an inference setting",
    "pad_token_id": "the tokenizer's",
    "bos_token_id": "the tokenizer's",
    "eos_token_id": "the tokenizer's (written for ByteLevelTokenizer runs)",
    "pretraining_tp": "splits the same matmuls into slices (the same function)",
    "max_window_layers": "read only with use_sliding_window (refused)",
    "sliding_window": "Qwen families: read only with use_sliding_window (refused); Mixtral: FIXED",
}

_SAME_STEP = "how a step is computed (the same step)"
# `ModelArgs` fields no stock family's config has, with why (the variant's fields travel in
# the native configs, `config.VARIANT_FIELDS`).
NOT_CARRIED: Dict[str, str] = {
    "seq_length": "a training setting; an import takes min(max_position_embeddings, 4096)",
    "normalization": "the family's (RMSNorm); export refuses another",
    "qk_layernorm": "the family's (a native Qwen3-MoE config says false)",
    "swiglu": "the family's (SwiGLU); export refuses another",
    "position_embedding_type": "the family's (RoPE); export refuses another",
    "add_qkv_bias": "the family's (Qwen2)",
    "add_bias_linear": "the family's (no biases); export refuses another",
    "hidden_dropout": "no family has a residual dropout",
    "moe_shared_expert_intermediate_size": "native Qwen3-MoE configs (ROUTER_FIELDS)",
    "moe_router_score_function": "native Qwen3-MoE configs (ROUTER_FIELDS)",
    "moe_router_enable_expert_bias": "native Qwen3-MoE configs (ROUTER_FIELDS)",
    "moe_router_topk_scaling_factor": "native Qwen3-MoE configs (ROUTER_FIELDS)",
    "moe_router_bias_update_rate": "a training setting no family has",
    "moe_router_dtype": "a training setting no family has",
    "moe_router_load_balancing_type": "a training setting no family has (see "
                                      "output_router_logits)",
    "moe_token_dispatcher_type": _SAME_STEP,
    "moe_grouped_gemm": _SAME_STEP,
    "make_vocab_size_divisible_by": "Megatron's row padding; an import pads to 128 unless told",
}


def of_family(table, fam_name: str):
    """The entries of `table` (`CARRIED` or `FIXED`) that apply to family `fam_name`."""
    return tuple(entry for entry in table
                 if entry.families is None or fam_name in entry.families)


def settings_left_out(args: RunArgs) -> List[str]:
    """`name=value` of each training or init setting of `args` that no family's config has
    (`NOT_CARRIED`), that changes what training computes and that differs from its default: an
    import of the export trains without it."""
    defaults = RunArgs()
    return [f"{name}={getattr(args, name)!r}" for name, why in NOT_CARRIED.items()
            if name in MODEL_FIELDS and declared(name).metadata["scope"] in ("init", "training")
            and why != _SAME_STEP and getattr(args, name) != getattr(defaults, name)]
