"""Megatron-side helpers of the checkpoint tests: models from converted checkpoints, logits,
and checkpoint rewrites."""

import torch

from megatron_mea.checkpoint.torch_dist.layerwise import read_checkpoint, write_checkpoint
from megatron_mea.checkpoint.torch_dist.model_only import (
    ModelDescription,
    build_stage_model,
    load_model_weights,
)


def megatron_logits(root, ids, inference_context=None, **parallel):
    """Logits `[b, s, V]` (gathered over TP) of the model of checkpoint `root`, built for the
    current parallel state (`parallel`: PretrainArgs sizes matching it)."""
    description = ModelDescription.load(root)
    model = build_stage_model(description, **parallel).eval()
    load_model_weights(model, root)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        out = model(ids, positions, attention_mask=None, inference_context=inference_context,
                    runtime_gather_output=True)
    return out[..., : description.args.vocab_size].float()


def rewrite_checkpoint(source, destination, edit, description=None):
    """Copy a checkpoint, passing every layer's tensors through `edit(layer, tensors)`."""
    description, groups = read_checkpoint(source, description)
    write_checkpoint(destination, description,
                     (edit(layer, tensors) for layer, tensors in groups), progress=False)
    return destination


def perturb_plugin_params(source, destination, scale=0.3, seed=5):
    """Copy a checkpoint with the plugin's parameters moved away from their identity init."""
    gen = torch.Generator().manual_seed(seed)

    def edit(layer, tensors):
        for name in sorted(tensors):
            if any(k in name for k in (".head_mix.", ".knock.", ".head_norm.")):
                noise = torch.randn(tensors[name].shape, generator=gen)
                tensors[name] = tensors[name] + scale * noise.to(tensors[name].dtype)
        return tensors

    return rewrite_checkpoint(source, destination, edit)
