"""Small MLA models and the per-rank bodies of the KHA-on-MLA tests (module level, so spawned
processes can import them).

The equivalence method is `tests/distributed/_workers.py`'s: a TP=1/EP=1 reference computes the
loss and every gradient on the global batch; its weights reach the parallel layout through a
`torch_dist` checkpoint; the parallel gradients (after DDP and `finalize_model_grads`) go back to
TP=1 through a checkpoint and are compared tensor by tensor.
"""

import contextlib
import importlib.util
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.post_training.modelopt.layers import Linear as DuplicatedLinear
from megatron.core.transformer import multi_latent_attention

from megatron_mea import get_gpt_decoder_block_spec
from megatron_mea.layers.kha_mla import MEAMLATransformerConfig
from tests._models import (
    CPU_EXACT,
    SEQ,
    TINY_MOE,
    VOCAB,
    batch,
    expert_tp_size,
    forward_loss,
    init_parallel,
    load_dist,
    perturb_plugin_params,
    save_dist,
)
from tests.distributed._workers import (
    _backward_in_micro_batches,
    _ddp,
    _my_sequences,
    grad_differences,
    reference_step,
    save_main_grads,
)

# Distinct sizes, so that a matrix applied to the wrong channels fails loudly: content
# dc = 16, RoPE dr = 8, value dv = 12.
MLA_SIZES = dict(
    q_lora_rank=32, kv_lora_rank=24, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=12
)


@contextlib.contextmanager
def mla_without_te():
    """Build MLA without Transformer Engine (both are Megatron-Core issues, not CPU ones).

    0.16.1: `multi_latent_attention` imports TE's classes from `extensions.transformer_engine`,
    which substitutes MagicMocks when TE is missing, so `HAVE_TE` is True and
    `isinstance(linear_proj, TELinear)` raises TypeError in `MultiLatentAttention.__init__`.
    0.19.2: without TE it binds `Linear` (the duplicated local linear the TE-less spec needs for
    the down-projections, `specs.apply_local_mla_down_projections`) to None, so
    `MLASelfAttention` refuses it as "Unsupported linear_q_down_proj".
    """
    if importlib.util.find_spec("transformer_engine") is not None:
        yield
        return
    saved = multi_latent_attention.HAVE_TE, multi_latent_attention.Linear
    multi_latent_attention.HAVE_TE = False
    multi_latent_attention.Linear = DuplicatedLinear
    try:
        yield
    finally:
        multi_latent_attention.HAVE_TE, multi_latent_attention.Linear = saved


def mla_config(variant="kha", *, tp=1, ep=1, sp=False, moe=True, **overrides):
    """A 2-layer MLA GPT config (layer 1 dense, layer 2 MoE), 4 heads, RMSNorm on the latents,
    plain RoPE; KHA-Linear on q, k and v unless overridden."""
    fields = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=96,
        normalization="RMSNorm",
        qk_layernorm=True,
        add_bias_linear=False,
        rope_type="rope",
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=expert_tp_size(tp, ep),
        sequence_parallel=sp,
        attention_variant=variant,
        **MLA_SIZES,
        **CPU_EXACT,
    )
    if variant == "kha":
        fields.update(kha_variant="linear")
    if moe:
        fields.update(TINY_MOE)
    fields.update(overrides)
    return MEAMLATransformerConfig(**fields)


def build_mla_gpt(config, seed=1234):
    """GPTModel with the plugin's block spec (local backend, torch SDPA core attention)."""
    torch.manual_seed(seed)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, core_attention="sdpa")
    with mla_without_te():
        return GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
            position_embedding_type="rope",
            share_embeddings_and_output_weights=False,
        )


def _knock_grads_identical_across_tp(model):
    """Whether every knock gradient is bit-identical on all TP ranks (a replicated parameter's
    checkpoint keeps one replica, so the TP=1 comparison alone could miss a wrong copy)."""
    group = parallel_state.get_tensor_model_parallel_group()
    size = dist.get_world_size(group)
    identical = {}
    for name, param in model.named_parameters():
        if "knock." in name:
            grad = param.main_grad.detach().contiguous()
            copies = [torch.empty_like(grad) for _ in range(size)]
            dist.all_gather(copies, grad, group=group)
            identical[name] = all(torch.equal(copies[0], c) for c in copies[1:])
    return identical


def equivalence(rank, world_size, tp, ep, sp, workdir):
    """KHA-MLA (perturbed knock) at TP=`tp`/EP=`ep`/SP vs TP=1: losses, max |grad diff| per
    parameter, and whether the knock gradients agree across TP ranks."""
    tokens, labels = batch(num_sequences=2)
    init_parallel(tp=1, ep=1)
    ref_losses, ref_grads = reference_step(
        build_mla_gpt(mla_config()), tokens, labels, os.path.join(workdir, "weights")
    )

    init_parallel(tp=tp, ep=ep)
    config = mla_config(tp=tp, ep=ep, sp=sp)
    parallel = build_mla_gpt(config)
    load_dist(parallel, os.path.join(workdir, "weights"))
    model = _ddp(config, parallel)
    mine = _my_sequences(tokens.shape[0])
    losses = _backward_in_micro_batches(model, tokens[mine], labels[mine], 1)
    finalize_model_grads([model])
    replicas = _knock_grads_identical_across_tp(parallel)
    save_main_grads(parallel, os.path.join(workdir, "grads"))

    init_parallel(tp=1, ep=1)
    grad_diff = grad_differences(
        build_mla_gpt(mla_config()), os.path.join(workdir, "grads"), ref_grads
    )
    return dict(
        losses=losses.detach(),
        ref_losses=ref_losses[mine],
        grad_diff=grad_diff,
        grad_scale=max(g.abs().max().item() for g in ref_grads.values()),
        knock_shapes={n: tuple(p.shape) for n, p in parallel.named_parameters() if "knock." in n},
        replicas=replicas,
    )


def checkpoint_round_trip(rank, world_size, workdir):
    """TP=2/SP -> TP=1 -> TP=2/SP through `torch_dist` checkpoints: losses and weights."""
    tokens, labels = batch(num_sequences=2)
    init_parallel(tp=2, ep=1)
    config = mla_config(tp=2, sp=True)
    first = build_mla_gpt(config)
    perturb_plugin_params(first, scale=0.5)  # same draw on every rank: replicas stay equal
    with torch.no_grad():
        loss_first = forward_loss(first, tokens, labels)
    save_dist(first, os.path.join(workdir, "tp2"))
    state_first = {k: v.clone() for k, v in first.state_dict().items() if torch.is_tensor(v)}

    init_parallel(tp=1, ep=1)
    middle = build_mla_gpt(mla_config())
    load_dist(middle, os.path.join(workdir, "tp2"))
    with torch.no_grad():
        loss_middle = forward_loss(middle, tokens, labels)
    save_dist(middle, os.path.join(workdir, "tp1"))

    init_parallel(tp=2, ep=1)
    last = build_mla_gpt(config)
    load_dist(last, os.path.join(workdir, "tp1"))
    with torch.no_grad():
        loss_last = forward_loss(last, tokens, labels)
    state_last = {k: v for k, v in last.state_dict().items() if torch.is_tensor(v)}
    return dict(
        loss_first=loss_first,
        loss_middle=loss_middle,
        loss_last=loss_last,
        same_keys=sorted(state_first) == sorted(state_last),
        same_state=all(torch.equal(state_first[k], state_last[k]) for k in state_first),
        knock_keys=sorted(k for k in state_first if "knock." in k),
    )
