"""Per-rank bodies of the distributed tests (module level, so spawned processes can import them).

Equivalence method: a TP=1/EP=1 reference model computes the loss and every gradient on the global
batch; its weights go through a `torch_dist` checkpoint into the parallel layout (Megatron's own
resharding); the parallel model runs with real DDP and `finalize_model_grads`; its gradients are
written into a model-shaped checkpoint and read back at TP=1, so each gradient is compared as one
full tensor against the reference.
"""

import contextlib
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

from megatron_mea.cpu import cuda_device_to_cpu
from megatron_mea.layers import enable_fold_cache, with_fold_flush
from tests._models import (
    batch,
    build_gpt,
    forward_loss,
    init_parallel,
    load_dist,
    perturb_plugin_params,
    save_dist,
    tiny_config,
)


def _ddp(config, model):
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False)
    return DistributedDataParallel(config, ddp_config, model)


def _my_sequences(num_sequences):
    """This rank's data-parallel slice of the global batch."""
    dp_rank = parallel_state.get_data_parallel_rank()
    per_rank = num_sequences // parallel_state.get_data_parallel_world_size()
    return slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)


def _count_folds(model):
    """Count `HeadMix.fold` calls (how often the `weights` exchange gathered K/V rows)."""
    calls = []
    for name, module in model.named_modules():
        if hasattr(module, "fold"):
            original = module.fold
            module.fold = lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k)
    return calls


def _backward_in_micro_batches(model, tokens, labels, micro_batches):
    """Per-sequence losses of the whole slice; gradients of their mean, accumulated over
    `micro_batches` forward/backward passes as Megatron's schedule does (no_sync but the last)."""
    losses = []
    chunks = list(zip(tokens.chunk(micro_batches), labels.chunk(micro_batches)))
    for index, (chunk_tokens, chunk_labels) in enumerate(chunks):
        last = index == len(chunks) - 1
        with (contextlib.nullcontext() if last else model.no_sync()):
            chunk_losses = forward_loss(model, chunk_tokens, chunk_labels)
            (chunk_losses.sum() / tokens.shape[0]).backward()
        losses.append(chunk_losses.detach())
    return torch.cat(losses)


def reference_step(reference, tokens, labels, weights_dir):
    """The TP=1 side: perturb `reference`'s plugin parameters, run the global batch forward and
    backward, save its weights to `weights_dir` (for the parallel layout to load).

    Returns: per-sequence losses `[b]`, {name: gradient}."""
    perturb_plugin_params(reference)
    losses = forward_loss(reference, tokens, labels)
    losses.mean().backward()
    save_dist(reference, weights_dir)
    return losses.detach(), {n: p.grad.clone() for n, p in reference.named_parameters()}


def save_main_grads(parallel, grads_dir):
    """Write the parallel model's reduced gradients (`main_grad`, after finalize_model_grads) as
    a model-shaped checkpoint, so that TP=1 reads each one back whole."""
    with torch.no_grad():
        for param in parallel.parameters():
            param.copy_(param.main_grad)
    save_dist(parallel, grads_dir)


def grad_differences(gathered, grads_dir, ref_grads) -> dict:
    """{name: max |gradient - reference gradient|}, the gradients read into the TP=1 model
    `gathered` from `grads_dir`."""
    load_dist(gathered, grads_dir)
    return {
        n: (p.detach() - ref_grads[n]).abs().max().item() for n, p in gathered.named_parameters()
    }


def equivalence(rank, world_size, variants, tp, ep, sp, workdir, micro_batches=1, fold_cache=False):
    """For each (name, fields): reference vs parallel losses and max |grad diff| per parameter.

    The parallel side runs `micro_batches` micro-batches; with `fold_cache` the MEA layers fold
    their weights once per step and `finalize_model_grads` is wrapped to flush the fold."""
    results = {}
    tokens, labels = batch(num_sequences=2)
    for name, fields in variants:
        root = os.path.join(workdir, name)
        init_parallel(tp=1, ep=1)
        ref_losses, ref_grads = reference_step(
            build_gpt(tiny_config(**fields)), tokens, labels, os.path.join(root, "weights")
        )

        init_parallel(tp=tp, ep=ep)
        config = tiny_config(**fields, tp=tp, ep=ep, sp=sp)
        parallel = build_gpt(config)
        load_dist(parallel, os.path.join(root, "weights"))
        model = _ddp(config, parallel)
        folds = _count_folds(parallel)
        finalize = finalize_model_grads
        if fold_cache:
            enable_fold_cache(parallel)
            finalize = with_fold_flush(finalize_model_grads)
        mine = _my_sequences(tokens.shape[0])
        losses = _backward_in_micro_batches(model, tokens[mine], labels[mine], micro_batches)
        finalize([model])
        save_main_grads(parallel, os.path.join(root, "grads"))

        init_parallel(tp=1, ep=1)
        grad_diff = grad_differences(
            build_gpt(tiny_config(**fields)), os.path.join(root, "grads"), ref_grads
        )
        grad_scale = max(g.abs().max().item() for g in ref_grads.values())
        results[name] = dict(
            losses=losses.detach(),
            ref_losses=ref_losses[mine],
            grad_diff=grad_diff,
            grad_scale=grad_scale,
            folds=len(folds),
        )
    return results


def replicas_after_steps(rank, world_size, variants, sp, moe, steps):
    """Train a few optimizer steps at TP=world; return, per variant, whether every TP-replicated
    plugin parameter is bit-identical across ranks and how far it moved from its init."""
    results = {}
    for name, fields in variants:
        init_parallel(tp=world_size, ep=1)
        config = tiny_config(**fields, tp=world_size, sp=sp, moe=moe)
        model = _ddp(config, build_gpt(config))
        replicated = {
            n: p for n, p in model.module.named_parameters() if ("head_mix." in n or "knock." in n)
        }
        initial = {n: p.detach().clone() for n, p in replicated.items()}
        with cuda_device_to_cpu():
            optimizer = get_megatron_optimizer(
                OptimizerConfig(optimizer="adam", lr=3e-2, weight_decay=0.1, clip_grad=1.0),
                [model],
            )
            for step in range(steps):
                tokens, labels = batch(num_sequences=2, seed=100 + step)
                model.zero_grad_buffer()
                optimizer.zero_grad()
                forward_loss(model, tokens, labels).mean().backward()
                finalize_model_grads([model])
                optimizer.step()
        identical, moved = {}, {}
        for n, p in replicated.items():
            copies = [torch.empty_like(p) for _ in range(world_size)]
            dist.all_gather(copies, p.detach().contiguous())
            identical[n] = all(torch.equal(copies[0], c) for c in copies[1:])
            moved[n] = (p.detach() - initial[n]).abs().max().item()
        results[name] = dict(identical=identical, moved=moved)
    return results


def checkpoint_round_trip(rank, world_size, fields, workdir):
    """TP2/SP/EP2 -> TP1 -> TP2/SP/EP2 through `torch_dist` checkpoints: losses and weights."""
    tokens, labels = batch(num_sequences=2)
    init_parallel(tp=2, ep=2)
    config = tiny_config(**fields, tp=2, ep=2, sp=True)
    first = build_gpt(config)
    perturb_plugin_params(first, scale=0.5)  # differently on each TP rank's shard: fine here
    mine = _my_sequences(tokens.shape[0])
    with torch.no_grad():
        loss_first = forward_loss(first, tokens[mine], labels[mine])
    save_dist(first, os.path.join(workdir, "tp2"))
    state_first = {k: v.clone() for k, v in first.state_dict().items() if torch.is_tensor(v)}

    init_parallel(tp=1, ep=1)
    middle = build_gpt(tiny_config(**fields))
    load_dist(middle, os.path.join(workdir, "tp2"))
    with torch.no_grad():
        loss_middle = forward_loss(middle, tokens, labels)[mine]
    save_dist(middle, os.path.join(workdir, "tp1"))

    init_parallel(tp=2, ep=2)
    last = build_gpt(config)
    load_dist(last, os.path.join(workdir, "tp1"))
    with torch.no_grad():
        loss_last = forward_loss(last, tokens[mine], labels[mine])
    state_last = {k: v for k, v in last.state_dict().items() if torch.is_tensor(v)}
    same = all(torch.equal(state_first[k], state_last[k]) for k in state_first)
    return dict(
        loss_first=loss_first, loss_middle=loss_middle, loss_last=loss_last,
        same_state=same, keys=sorted(state_first) == sorted(state_last),
    )


def replicated_grad_sums(rank, world_size):
    """`tp_replicated` with a gradient that arrives non-contiguous (a transpose's backward)."""
    from megatron_mea.parallel import tp_replicated

    init_parallel(tp=world_size)
    group = parallel_state.get_tensor_model_parallel_group()
    param = torch.zeros(3, 2, requires_grad=True)
    upstream = torch.arange(6.0).view(2, 3) * (rank + 1)
    tp_replicated(param, group).t().backward(upstream)  # grad = upstream.t(), not contiguous
    return param.grad
