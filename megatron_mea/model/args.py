"""The model description, declared once: every architecture field of a GPT model.

`ModelArgs` is the one declaration of the fields that decide a model's function and tensors
(layers, widths, heads, norms, positions, vocabulary, experts, router), with the attention-variant
fields of `megatron_mea.variant` inherited. Everything else derives from it:
- `mea-pretrain`'s `PretrainArgs` inherits the fields (its flags and YAML keys are generated);
- `config_fields` is the one translation to `MEATransformerConfig` fields, `gpt_model_kwargs` the
  one to `GPTModel`'s other arguments (the trainer, the converters and inference use both);
- `megatron_mea.model.size.ModelShape` inherits the fields for the size arithmetic;
- a Megatron-LM checkpoint's saved arguments are read field by field (same names).

Each field's `metadata`:
- `scope`: `"model"` (function and parameters), `"init"` (initial values only) or `"training"`
  (how training computes the same function), as in `megatron_mea.variant`;
- `config`: the `TransformerConfig` field it sets (None: a `GPTModel` argument or the vocabulary);
- `tensors`: it decides which tensors the model has and their shapes (a checkpoint of another
  value does not load).

Every field is named as the attribute of Megatron-LM's argument namespace that holds it (a test
checks the names against Megatron-LM's flags at both supported tags), so a Megatron-LM run's saved
arguments are read field by field.

Pure Python at import (torch only inside `config_fields`), so that every tool can import it.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import List, Literal, Optional, Tuple, Union

from megatron_mea.variant import AttentionVariantFields


def _declared(default, scope: str, config: Optional[str] = None, tensors: bool = False):
    return field(
        default=default, metadata={"scope": scope, "config": config, "tensors": tensors}
    )


# Fields whose translation is not a plain copy (`config_fields` spells each out).
_DERIVED = "derived"


@dataclass
class ModelArgs(AttentionVariantFields):
    """The architecture of a Megatron-Core GPT model (Megatron-LM flag names, underscored).

    Defaults: a CPU-sized MoE GPT (`mea-pretrain`'s defaults)."""

    num_layers: int = _declared(2, "model", "num_layers", tensors=True)
    hidden_size: int = _declared(128, "model", "hidden_size", tensors=True)
    ffn_hidden_size: Optional[int] = _declared(None, "model", _DERIVED, tensors=True)
    """Dense MLP width. Default 4 x hidden_size."""
    num_attention_heads: int = _declared(8, "model", "num_attention_heads", tensors=True)
    num_query_groups: Optional[int] = _declared(None, "model", "num_query_groups", tensors=True)
    kv_channels: Optional[int] = _declared(None, "model", "kv_channels", tensors=True)
    seq_length: int = _declared(128, "model")
    max_position_embeddings: Optional[int] = _declared(None, "model")
    """Positions the model supports (RoPE tables, learned positions). Default seq_length."""
    normalization: Literal["LayerNorm", "RMSNorm"] = _declared(
        "RMSNorm", "model", "normalization", tensors=True
    )
    qk_layernorm: bool = _declared(True, "model", "qk_layernorm", tensors=True)
    swiglu: bool = _declared(True, "model", _DERIVED, tensors=True)
    untie_embeddings_and_output_weights: bool = _declared(True, "model", tensors=True)
    position_embedding_type: Literal["rope", "learned_absolute", "none"] = _declared(
        "rope", "model", tensors=True
    )
    rotary_base: float = _declared(10000.0, "model")
    use_rope_scaling: bool = _declared(False, "model")
    """Llama 3.x (`rope_type: llama3`) RoPE frequency scaling, as Megatron-Core implements it."""
    rope_scaling_factor: float = _declared(8.0, "model")
    """The llama3 scaling `factor` (Megatron-Core fixes its other parameters)."""
    layernorm_epsilon: float = _declared(1e-5, "model", "layernorm_epsilon")
    add_qkv_bias: bool = _declared(False, "model", "add_qkv_bias", tensors=True)
    add_bias_linear: bool = _declared(False, "model", "add_bias_linear", tensors=True)
    """Biases on every linear layer (Megatron-LM's default; `--disable-bias-linear` clears it)."""
    init_method_std: float = _declared(0.02, "init", "init_method_std")
    hidden_dropout: float = _declared(0.0, "training", "hidden_dropout")
    attention_dropout: float = _declared(0.0, "training", "attention_dropout")
    num_experts: Optional[int] = _declared(4, "model", "num_moe_experts", tensors=True)
    moe_router_topk: int = _declared(2, "model", "moe_router_topk")
    moe_ffn_hidden_size: Optional[int] = _declared(None, "model", _DERIVED, tensors=True)
    """Expert MLP width. Default ffn_hidden_size."""
    moe_shared_expert_intermediate_size: Optional[int] = _declared(
        None, "model", "moe_shared_expert_intermediate_size", tensors=True
    )
    """Width of the shared expert every token passes through (None: no shared expert)."""
    moe_layer_freq: Union[int, List[int]] = _declared(1, "model", "moe_layer_freq", tensors=True)
    """1 in N layers is MoE (an int), or a 0/1 pattern with one entry per layer (a list)."""
    moe_router_pre_softmax: bool = _declared(False, "model", "moe_router_pre_softmax")
    """Softmax over all experts, then top-k (no renormalisation); default: top-k of the logits,
    then softmax over the k chosen."""
    moe_router_score_function: Literal["softmax", "sigmoid"] = _declared(
        "softmax", "model", "moe_router_score_function"
    )
    """Router scores: softmax, or a sigmoid per expert (the chosen k renormalised to sum 1)."""
    moe_router_enable_expert_bias: bool = _declared(
        False, "model", "moe_router_enable_expert_bias", tensors=True
    )
    """Aux-loss-free balancing (sigmoid router): a per-expert bias added to the scores for the
    choice of experts only, updated from the token counts after every step."""
    moe_router_bias_update_rate: float = _declared(
        1e-3, "training", "moe_router_bias_update_rate"
    )
    """Step of the expert-bias update (sign of the load deviation times this rate)."""
    moe_router_topk_scaling_factor: Optional[float] = _declared(
        None, "model", "moe_router_topk_scaling_factor"
    )
    """Multiply the routing weights of the chosen experts by this factor."""
    moe_router_dtype: Optional[Literal["fp32", "fp64"]] = _declared(
        None, "training", "moe_router_dtype"
    )
    """Compute the router's logits and scores in this precision (None: the model's)."""
    moe_router_load_balancing_type: Literal[
        "aux_loss", "seq_aux_loss", "global_aux_loss", "none"
    ] = _declared("aux_loss", "training", "moe_router_load_balancing_type")
    moe_aux_loss_coeff: float = _declared(1e-2, "training", "moe_aux_loss_coeff")
    moe_token_dispatcher_type: Literal["allgather", "alltoall"] = _declared(
        "alltoall", "training", "moe_token_dispatcher_type"
    )
    moe_grouped_gemm: bool = _declared(False, "training", "moe_grouped_gemm")
    vocab_size: Optional[int] = _declared(None, "model")
    """Tokens of the tokenizer (None: the tokenizer's size)."""
    make_vocab_size_divisible_by: int = _declared(128, "model")
    """Embedding and output rows are padded to a multiple of this."""

    @property
    def padded_vocab_size(self) -> int:
        """Vocabulary padded to a multiple of `make_vocab_size_divisible_by`.

        Unlike Megatron-LM, the multiple does not grow with the TP size, so a checkpoint keeps
        the same vocabulary rows when it is resumed at another TP layout (validation checks the
        multiple is divisible by TP)."""
        multiple = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // multiple) * multiple


@dataclass
class RunArgs(ModelArgs):
    """The model with what its checkpoints record of the run that wrote them: the parallel
    layout, the precision, the layer implementation, the tokenizer and the seed.

    Everything that rebuilds a checkpoint's model at some layout reads these (the converters'
    description, inference, the library's `megatron_mea.model.gpt`); `mea-pretrain`'s `PretrainArgs`
    adds the training settings. A run's `config.yaml` holds all of its arguments; a reader of
    `RunArgs` takes these fields from it (`megatron_mea.model.run_config.load_run_args`)."""

    # ---- parallelism --------------------------------------------------------------------------
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None
    context_parallel_size: int = 1
    sequence_parallel: bool = False
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    """Interleaved (virtual) pipeline: layers per model chunk; each pipeline rank holds
    num_layers / (pipeline_model_parallel_size x this) chunks (Megatron-LM's flag)."""
    # ---- precision and implementation ---------------------------------------------------------
    bf16: bool = False
    fp8_format: Optional[Literal["e4m3", "hybrid"]] = None
    fp8_recipe: Literal["delayed", "tensorwise", "blockwise", "mxfp8"] = "delayed"
    transformer_impl: Literal["local", "transformer_engine"] = "local"
    core_attention: Literal["megatron", "sdpa"] = "megatron"
    """Core attention of the local spec: Megatron's unfused DotProductAttention or torch's
    scaled_dot_product_attention (the same function; transformer_impl=local only)."""
    # ---- tokenizer and seed -------------------------------------------------------------------
    tokenizer_type: Literal["ByteLevelTokenizer", "HuggingFaceTokenizer"] = "ByteLevelTokenizer"
    tokenizer_model: Optional[str] = None
    seed: int = 1234

    @property
    def virtual_pipeline_model_parallel_size(self) -> Optional[int]:
        """Model chunks per pipeline rank, derived as Megatron-LM does (None: no interleaving,
        also when these arguments are reused without pipeline parallelism, e.g. for inference)."""
        if not self.num_layers_per_virtual_pipeline_stage or self.pipeline_model_parallel_size < 2:
            return None
        per_stage = self.num_layers // self.pipeline_model_parallel_size
        chunks = per_stage // self.num_layers_per_virtual_pipeline_stage
        return chunks if chunks > 1 else None


RUN_FIELDS = tuple(f.name for f in dataclasses.fields(RunArgs))
# The parallel layout's sizes, under the names Megatron-Core's `initialize_model_parallel` and
# `TransformerConfig` both take.
PARALLEL_SIZES = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "context_parallel_size",
)
MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(ModelArgs))
# The model fields beyond the attention variant's (which `megatron_mea.variant` declares).
ARCHITECTURE_FIELDS = tuple(
    f.name for f in dataclasses.fields(ModelArgs) if "config" in f.metadata
)
# The MoE fields that exist in the config only for an MoE model.
_MOE_ONLY = tuple(name for name in ARCHITECTURE_FIELDS if name.startswith("moe_"))


# The fields that decide the model's tensors and their shapes (the attention variant's are its
# fields of scope "model").
TENSOR_FIELDS = tuple(
    f.name for f in dataclasses.fields(ModelArgs) if f.metadata.get("tensors")
)


def declared(name: str) -> dataclasses.Field:
    """The declaration of model field `name`."""
    return {f.name: f for f in dataclasses.fields(ModelArgs)}[name]


def parallel_sizes(run: RunArgs) -> dict:
    """The run's `PARALLEL_SIZES`, by name."""
    return {name: getattr(run, name) for name in PARALLEL_SIZES}


def derived_sizes(model: ModelArgs) -> dict:
    """The sizes of `model` (any object with the `ModelArgs` fields), those left unset filled in:
    GQA groups = heads, head dim = hidden / heads, FFN = 4 * hidden (Megatron-Core's default, also
    with SwiGLU, where Megatron-LM's `validate_args` would round 8h/3 down to a multiple of 64: a
    checkpoint's arguments record the size used), expert FFN = FFN (MoE only, else None),
    positions = the sequence length. The one place these defaults live."""
    heads = model.num_attention_heads
    ffn = model.ffn_hidden_size or 4 * model.hidden_size
    return dict(
        num_query_groups=model.num_query_groups or heads,
        kv_channels=model.kv_channels or model.hidden_size // heads,
        ffn_hidden_size=ffn,
        moe_ffn_hidden_size=(model.moe_ffn_hidden_size or ffn) if model.num_experts else None,
        max_position_embeddings=model.max_position_embeddings or model.seq_length,
    )


def moe_layers(model: ModelArgs) -> Tuple[bool, ...]:
    """Per 0-based layer of `model` (any object with the `ModelArgs` fields), whether it is an MoE
    layer: the one answer, for the size accounting and the converters. None without experts;
    else Megatron-Core's rule for `moe_layer_freq`: an int N makes every N-th layer MoE, starting
    with layer 0; a list gives one 0/1 entry per layer."""
    if not model.num_experts:
        return (False,) * model.num_layers
    return moe_layers_of_freq(model.moe_layer_freq, model.num_layers)


def moe_layers_of_freq(
    moe_layer_freq: Union[int, List[int]], num_layers: int
) -> Tuple[bool, ...]:
    """`moe_layers`' rule on `moe_layer_freq` alone (for a config that has experts)."""
    if isinstance(moe_layer_freq, int):
        return tuple(layer % moe_layer_freq == 0 for layer in range(num_layers))
    return tuple(bool(entry) for entry in moe_layer_freq)


def config_fields(model: ModelArgs) -> dict:
    """The `MEATransformerConfig` fields of the architecture of `model` (any object with the
    `ModelArgs` fields): the one translation, parallel layout and fusions excluded."""
    import torch.nn.functional as F

    from megatron_mea.variant import variant_settings

    fields = {}
    for f in dataclasses.fields(ModelArgs):
        target = f.metadata.get("config")
        if target and target != _DERIVED and not f.name.startswith("moe_"):
            fields[target] = getattr(model, f.name)
    sizes = derived_sizes(model)
    fields.update(
        ffn_hidden_size=sizes["ffn_hidden_size"],
        gated_linear_unit=model.swiglu,
        activation_func=F.silu if model.swiglu else F.gelu,
        **variant_settings(model),
    )
    if model.num_experts:
        for name in _MOE_ONLY:
            target = declared(name).metadata["config"]
            if target != _DERIVED:
                fields[target] = getattr(model, name)
        fields["moe_ffn_hidden_size"] = sizes["moe_ffn_hidden_size"]
    else:
        fields["num_moe_experts"] = None
    return fields


def gpt_model_kwargs(model: ModelArgs) -> dict:
    """`GPTModel` arguments besides the config and the spec: vocabulary, positions, RoPE."""
    return dict(
        vocab_size=model.padded_vocab_size,
        max_sequence_length=derived_sizes(model)["max_position_embeddings"],
        share_embeddings_and_output_weights=not model.untie_embeddings_and_output_weights,
        position_embedding_type=model.position_embedding_type,
        rotary_base=model.rotary_base,
        rope_scaling=model.use_rope_scaling,
        rope_scaling_factor=model.rope_scaling_factor,
    )
