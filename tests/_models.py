"""Small Megatron models and parallel setup shared by the tests (CPU, fp32, deterministic)."""

import os

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.models.gpt import GPTModel

from megatron_mea import MEATransformerConfig, get_gpt_decoder_block_spec
from megatron_mea.apps.configs import TINY, flags
from megatron_mea.cpu import init_cpu_rng_tracker

VOCAB = 96
SEQ = 16

# Settings that keep CPU runs exact and free of CUDA-only fusions.
CPU_EXACT = dict(
    use_cpu_initialization=True,
    params_dtype=torch.float32,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    bias_dropout_fusion=False,
    masked_softmax_fusion=False,
    gradient_accumulation_fusion=False,
    apply_rope_fusion=False,
    persist_layer_norm=False,
)


def expert_tp_size(tp, ep):
    """Expert TP: 1 with EP (the common MoE layout; gloo cannot all-gather the uneven token
    counts that expert TP > 1 produces), else TP (with EP=1 and expert TP=1, Megatron would not
    reduce expert gradients across the TP ranks that replicate the experts)."""
    return 1 if ep > 1 else tp


# The MoE part of the tiny configs: layer 2 of 2 is MoE, no load-balancing loss (losses then do not
# depend on how tokens are sharded).
TINY_MOE = dict(
    num_moe_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=48,
    moe_layer_freq=[0, 1],
    moe_router_load_balancing_type="none",
    moe_token_dispatcher_type="alltoall",
)


def tiny_config(variant="standard", *, tp=1, ep=1, sp=False, moe=True, **overrides):
    """A 2-layer GPT config (layer 1 dense, layer 2 MoE), GQA 8 heads / 4 groups, hn 8, RMSNorm
    q/k norms. No load-balancing loss, so losses do not depend on how tokens are sharded."""
    fields = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=8,
        num_query_groups=4,
        ffn_hidden_size=96,
        normalization="RMSNorm",
        qk_layernorm=True,
        add_bias_linear=False,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=expert_tp_size(tp, ep),
        sequence_parallel=sp,
        attention_variant=variant,
        **CPU_EXACT,
    )
    if moe:
        fields.update(TINY_MOE)
    fields.update(overrides)
    return MEATransformerConfig(**fields)


def tiny_flags(**overrides):
    """The tests' tiny model (`megatron_mea.apps.configs.TINY`: 2 MoE layers, 4 heads in 2
    groups, hidden 64, sequences of 32) as `mea-pretrain` flags, with `overrides` (argument
    names; None drops a setting, True is a bare flag): `tiny_flags(mock_data=True,
    train_iters=4)`. Not `tiny_config`'s model, which the in-process tests build directly."""
    return flags(TINY, **overrides)


def build_gpt(config, seed=1234):
    """GPTModel with the plugin's block spec (local backend), RoPE, untied output layer."""
    torch.manual_seed(seed)
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_decoder_block_spec(config, use_transformer_engine=False),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )


def init_parallel(tp=1, ep=1, seed=1234):
    """Join the gloo group (env from tests/_dist.py) and set TP/EP (inside megatron_on_cpu)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=expert_tp_size(tp, ep),
    )
    init_cpu_rng_tracker(seed)


def batch(num_sequences=2, seed=7):
    """Token ids and labels `[b, s]`, identical on every rank."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (num_sequences, SEQ + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def forward_loss(model, tokens, labels):
    """Mean next-token loss of each sequence `[b]` (Megatron returns per-token losses)."""
    position_ids = torch.arange(tokens.shape[1]).expand_as(tokens)
    per_token = model(tokens, position_ids, attention_mask=None, labels=labels)
    return per_token.float().mean(dim=1)


def perturb_plugin_params(model, seed=99, scale=0.3):
    """Move the variant's parameters (and the q/k norm scales) away from their identity init, the
    same way on every rank, so that equivalence tests exercise real mixing."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if any(key in name for key in ("head_mix.", "knock.", "head_norm.", "layernorm.")):
                param.add_(scale * torch.randn(param.shape, generator=gen))


def save_dist(model, directory):
    """`torch_dist` checkpoint of the model's sharded state dict (all ranks call it)."""
    os.makedirs(directory, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), directory)


def load_dist(model, directory):
    """Load a `torch_dist` checkpoint saved at any TP/EP layout into `model` (strict)."""
    state = dist_checkpointing.load(model.sharded_state_dict(), directory)
    model.load_state_dict(state)


def read_checkpoint_tensors(directory) -> dict:
    """Every tensor of a `torch_dist` checkpoint directory, whole (global shapes), by key;
    read in this process without a process group."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(str(directory))
    metadata = reader.read_metadata().state_dict_metadata
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    dcp_load(state, storage_reader=reader, no_dist=True)
    return state
