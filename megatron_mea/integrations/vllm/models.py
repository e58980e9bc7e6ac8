"""vLLM causal LMs of the native MEA / KHA exports (`MegatronMEA<Family>ForCausalLM`).

One decoder stack for every family: vLLM's embedding, RMS norms, LM head and the family's own
MLP / MoE block (`LlamaMLP`, `Qwen2MLP`, `Qwen3MoeSparseMoeBlock`, `MixtralMoE`, so its fused
MoE and tensor parallelism apply), with `VariantAttention` as every layer's `self_attn`.
Checkpoint names are the exports' (the family's Hugging Face names plus the plugin's
parameters); pipeline parallelism is not supported.
"""

import logging
from itertools import islice

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.distributed import (
    get_pp_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.models.utils import (
    AutoWeightsLoader,
    WeightsMapper,
    extract_layer_index,
    make_layers,
    maybe_prefix,
)

from megatron_mea.integrations.kv_per_rank import tp_loses_kv_saving_message
from megatron_mea.integrations.transformers.configuration_megatron_mea import router_outside_stock
from megatron_mea.integrations.vllm.attention import VariantAttention

logger = logging.getLogger(__name__)


def _llama_mlp(vllm_config, config, prefix):
    from vllm.model_executor.models.llama import LlamaMLP

    return LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                    quant_config=vllm_config.quant_config,
                    bias=getattr(config, "mlp_bias", False), prefix=prefix)


def _qwen_mlp(vllm_config, config, prefix):
    from vllm.model_executor.models.qwen2 import Qwen2MLP

    return Qwen2MLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                    quant_config=vllm_config.quant_config, prefix=prefix)


def _qwen3_moe_mlp(vllm_config, config, prefix):
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeMLP, Qwen3MoeSparseMoeBlock

    layer = extract_layer_index(prefix)
    sparse = (layer not in (getattr(config, "mlp_only_layers", None) or [])
              and config.num_experts > 0 and (layer + 1) % config.decoder_sparse_step == 0)
    if sparse:
        return Qwen3MoeSparseMoeBlock(vllm_config=vllm_config, prefix=prefix)
    return Qwen3MoeMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                       quant_config=vllm_config.quant_config, prefix=prefix)


def _mixtral_moe(vllm_config, config, prefix):
    from vllm.model_executor.models.mixtral import MixtralMoE

    return MixtralMoE(config.num_local_experts, config.num_experts_per_tok, config.hidden_size,
                      config.intermediate_size, quant_config=vllm_config.quant_config,
                      prefix=prefix)


class VariantDecoderLayer(nn.Module):
    """Pre-norm decoder layer: `VariantAttention`, then the family's MLP (named `mlp_name`)."""

    def __init__(self, vllm_config, prefix, family):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.self_attn = VariantAttention(
            config, vllm_config.cache_config, vllm_config.quant_config,
            prefix=f"{prefix}.self_attn", qkv_bias=family.qkv_bias, qk_norm=family.qk_norm,
        )
        self.mlp_name = family.mlp_name
        self.add_module(family.mlp_name,
                        family.mlp(vllm_config, config, f"{prefix}.{family.mlp_name}"))
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return getattr(self, self.mlp_name)(hidden_states), residual


# Dense MLPs stack gate/up into `gate_up_proj`; experts keep their names (the fused-MoE loader
# reads them). q/k/v are left to `VariantAttention.load_weights`.
_WEIGHTS_MAPPER = WeightsMapper(orig_to_new_stacked={
    ".mlp.gate_proj": (".mlp.gate_up_proj", 0),
    ".mlp.up_proj": (".mlp.gate_up_proj", 1),
})


@support_torch_compile
class VariantModel(nn.Module):
    """Embedding, decoder layers, final norm."""

    def __init__(self, *, vllm_config, prefix="", family=None):
        super().__init__()
        config = vllm_config.model_config.hf_config
        if get_pp_group().world_size > 1:
            raise ValueError("megatron_mea's vLLM models do not support pipeline parallelism")
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   prefix=f"{prefix}.embed_tokens")
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: VariantDecoderLayer(vllm_config, prefix, family),
            prefix=f"{prefix}.layers",
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden_states = inputs_embeds if inputs_embeds is not None \
            else self.embed_input_ids(input_ids)
        residual = None
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    def load_weights(self, weights):
        return AutoWeightsLoader(self).load_weights(weights, mapper=_WEIGHTS_MAPPER)


def _refuse_what_vllm_layers_cannot_compute(config) -> None:
    """Native Qwen3-MoE exports that route as only Megatron does (the sigmoid router, an expert
    bias, top-k scaling, a shared expert) or have no QK norm (`qk_layernorm` false) are computed
    by `megatron_mea.integrations.transformers`'s modeling code; vLLM's `Qwen3MoeSparseMoeBlock`
    would compute another
    function. Refused, naming the field."""
    router = router_outside_stock(config)
    if router:
        raise ValueError(
            f"{router[0]} ({router[1]!r}): Megatron's router is not served by the vLLM plugin "
            "(vLLM's Qwen3-MoE block routes otherwise); use the export with transformers"
        )
    if getattr(config, "qk_layernorm", True) is False:
        raise ValueError(
            "qk_layernorm (False): a Qwen3-MoE export without QK norm is not served by the "
            "vLLM plugin; use the export with transformers"
        )


class VariantForCausalLM(nn.Module):
    """Causal LM of a native export; `family` (a class attribute) picks the MLP and the
    attention's biases / q-k norms."""

    family = None

    def __init__(self, *, vllm_config, prefix=""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        _refuse_what_vllm_layers_cannot_compute(config)
        message = tp_loses_kv_saving_message(config, get_tensor_model_parallel_world_size())
        if message and get_tensor_model_parallel_rank() == 0:
            logger.warning(message)
        self.config = config
        self.model = VariantModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"),
                                  family=self.family)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size,
                                      quant_config=vllm_config.quant_config,
                                      prefix=maybe_prefix(prefix, "lm_head"))
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights):
        return AutoWeightsLoader(self).load_weights(weights)


class VLLMFamily:
    """What differs between the families in vLLM: the MLP block (and its attribute name), q/k/v
    biases, q/k norms (the key maps of the conversions are `checkpoint.hf.families.Family`)."""

    def __init__(self, mlp, mlp_name="mlp", qkv_bias=False, qk_norm=False):
        self.mlp, self.mlp_name, self.qkv_bias, self.qk_norm = mlp, mlp_name, qkv_bias, qk_norm


FAMILIES = {
    "Llama": VLLMFamily(_llama_mlp),
    "Qwen2": VLLMFamily(_qwen_mlp, qkv_bias=True),
    "Qwen3": VLLMFamily(_qwen_mlp, qk_norm=True),
    "Qwen3Moe": VLLMFamily(_qwen3_moe_mlp, qk_norm=True),
    "Mixtral": VLLMFamily(_mixtral_moe, mlp_name="block_sparse_moe"),
}


def _causal_lm(family_name):
    name = f"MegatronMEA{family_name}ForCausalLM"
    return type(name, (VariantForCausalLM,), {
        "family": FAMILIES[family_name],
        "__doc__": f"{family_name} with MEA / KHA attention, for vLLM.",
        "__module__": __name__,
        "__qualname__": name,
    })


# Module-level names: vLLM's registry imports them as `module:ClassName`.
MegatronMEALlamaForCausalLM = _causal_lm("Llama")
MegatronMEAQwen2ForCausalLM = _causal_lm("Qwen2")
MegatronMEAQwen3ForCausalLM = _causal_lm("Qwen3")
MegatronMEAQwen3MoeForCausalLM = _causal_lm("Qwen3Moe")
MegatronMEAMixtralForCausalLM = _causal_lm("Mixtral")
ARCHITECTURES = tuple(f"MegatronMEA{name}ForCausalLM" for name in FAMILIES)
