"""Tiny random Hugging Face models of every supported family, built from configs (nothing is
downloaded), saved as safetensors checkpoints for the converters, and edited copies of them."""

import json
import os
import shutil

import torch

VOCAB = 96
SEQ = 12
# 8 query heads / 4 KV heads of 8 channels, 2 layers: GQA, several heads per TP rank at TP=2.
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=8,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")


def llama3_rope(factor=32.0, **changes):
    """`rope_parameters` of Llama 3.2's llama3 scaling (factor 32) with a large theta: at head
    dim 8 the two slowest of the 4 frequencies are scaled, the position-127 angle of the
    third by ~0.1 rad, so it shows in the logits of 128 tokens; `changes` edit the dict."""
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": factor,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    return dict(rope, **changes)


# A Llama 3.x-style tiny model: llama3 RoPE scaling (transformers wants the context above the
# original 8192 positions).
LLAMA3 = dict(rope_parameters=llama3_rope(), max_position_embeddings=16384)


def hf_config(family, **overrides):
    """The transformers config of a tiny `family` model."""
    from transformers import (
        LlamaConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    fields = dict(COMMON)
    if family == "llama":
        cls = LlamaConfig
        fields.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    elif family == "qwen2":
        cls = Qwen2Config
    elif family == "qwen3":
        cls = Qwen3Config
    elif family == "qwen3_moe":
        cls = Qwen3MoeConfig
        # Layer 0 dense, layer 1 MoE; no top-k renormalisation (Megatron's pre-softmax routing).
        fields.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                      mlp_only_layers=[0], norm_topk_prob=False)
    elif family == "mixtral":
        cls = MixtralConfig
        fields.update(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)
    else:
        raise ValueError(family)
    fields.update(overrides)
    return cls(**fields)


def build_hf_model(family, seed=0, **overrides):
    """A random fp32 causal LM of `family` in eval mode, with non-trivial norm scales and biases."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = hf_config(family, **overrides)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.add_(0.1 * torch.randn_like(param))
            elif name.endswith(("gate.weight", "embed_tokens.weight", "lm_head.weight")):
                param.normal_(0, 0.5)
    return model


def save_hf_model(model, directory):
    """Save as safetensors (the format the importer reads)."""
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def edited_copy(hf_dir, destination, edit_tensors=None, edit_config=None):
    """Copy an HF checkpoint directory, passing its tensors (a dict) and its config.json (a dict)
    through the given functions, which edit them in place; returns `destination`."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(hf_dir, destination)
    if edit_tensors:
        path = os.path.join(destination, "model.safetensors")
        tensors = load_file(path)
        edit_tensors(tensors)
        save_file(tensors, path, metadata={"format": "pt"})
    if edit_config:
        path = os.path.join(destination, "config.json")
        with open(path) as handle:
            config = json.load(handle)
        edit_config(config)
        with open(path, "w") as handle:
            json.dump(config, handle)
    return destination


def tokens(batch=2, seed=3, seq=SEQ, vocab=VOCAB):
    """Token ids `[b, s]`."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=gen)


def hf_logits(model, ids):
    """Logits `[b, s, V]` of an HF causal LM."""
    with torch.no_grad():
        return model(ids).logits.float()


def assert_same_hf_checkpoint(expected_dir, got_dir, config=True):
    """The two HF directories hold the same tensors (bit for bit) and, with `config`, the same
    config.json."""
    from safetensors.torch import load_file

    expected, got = (load_file(os.path.join(d, "model.safetensors"))
                     for d in (expected_dir, got_dir))
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    if config:
        configs = []
        for directory in (expected_dir, got_dir):
            with open(os.path.join(directory, "config.json")) as handle:
                configs.append(json.load(handle))
        assert configs[1] == configs[0]
