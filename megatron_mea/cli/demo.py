"""`make demo` until the training driver lands: build each variant on CPU and show what it does.

Builds a small MoE GPT (Megatron-Core, local spec, one gloo process) as the plain baseline, MEA,
MEA with virtual heads, KHA-Linear and KHA-MLP; prints their parameter and KV-cache sizes,
checks that the identity-initialised variants compute exactly the baseline, and takes a few
optimizer steps on a fixed batch so the losses can be compared.
"""

import os
import socket
import time
import warnings

import torch

VARIANTS = [
    ("baseline", dict(attention_variant="standard")),
    ("mea", dict(attention_variant="mea", mea_head_norm=False)),
    ("mea+head-norm", dict(attention_variant="mea")),
    ("mea-virtual nc=2", dict(attention_variant="mea", mea_num_kv_components=2)),
    ("kha-linear", dict(attention_variant="kha", kha_variant="linear")),
    ("kha-mlp", dict(attention_variant="kha", kha_variant="mlp")),
]

PLAN = """What `make demo` will run once the training driver lands (issue 3):
  1. build a corpus from the Python standard library's source and docs on this machine,
  2. preprocess it into Megatron .bin/.idx files with the built-in byte-level tokenizer,
  3. pretrain a small MoE GPT with MEA, KHA and the plain baseline (same data, same seed) for a few
     hundred steps on CPU, with torch_dist checkpoints and TensorBoard logs,
  4. print a summary table (final train / validation loss, tokens/s) and save a loss-curve PNG."""


def _init_single_process():
    from megatron.core import parallel_state

    from megatron_mea.cpu import apply_cpu_patches, init_cpu_rng_tracker

    apply_cpu_patches()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel()
    init_cpu_rng_tracker(1234)


def _build(fields):
    from megatron.core.models.gpt import GPTModel

    from megatron_mea import MEATransformerConfig, get_gpt_decoder_block_spec

    config = MEATransformerConfig(
        num_layers=2, hidden_size=128, num_attention_heads=8, num_query_groups=4,
        ffn_hidden_size=256, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=128,
        moe_router_load_balancing_type="none", normalization="RMSNorm", qk_layernorm=True,
        add_bias_linear=False, use_cpu_initialization=True, hidden_dropout=0.0,
        attention_dropout=0.0, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False, **fields,
    )
    torch.manual_seed(1234)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=256,
                     max_sequence_length=64, position_embedding_type="rope")
    return config, model


def main():
    warnings.filterwarnings("ignore")
    print(PLAN, "\n")
    _init_single_process()
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (4, 65), generator=gen)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(64).expand_as(inputs)
    baseline_logits = None
    print(f"{'variant':<18}{'params':>9}{'KV cache B/token':>18}{'same as baseline':>18}"
          f"{'loss@0':>9}{'loss@20':>9}{'s/step':>8}")
    for name, fields in VARIANTS:
        config, model = _build(fields)
        own = model.state_dict()
        if baseline_logits is None:
            # Cloned: the baseline trains in place below.
            baseline_state = {k: v.clone() if torch.is_tensor(v) else v for k, v in own.items()}
        shared = {k: v for k, v in baseline_state.items() if k in own and (
            not torch.is_tensor(v) or v.shape == own[k].shape)}
        model.load_state_dict(shared, strict=False)
        with torch.no_grad():
            logits = model(inputs, positions, attention_mask=None)
        if baseline_logits is None:
            baseline_logits = logits
        if len(shared) < len(baseline_state):
            identical = "other K/V shape"
        else:
            identical = "exact" if torch.equal(logits, baseline_logits) else "no (head norm)"
        kv_heads = getattr(config, "mea_num_kv_components", None) or config.num_query_groups
        kv_bytes = 2 * config.num_layers * kv_heads * config.kv_channels * 2  # bf16 K and V
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        losses, start = [], time.perf_counter()
        for _ in range(21):
            loss = model(inputs, positions, attention_mask=None, labels=labels).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        seconds = (time.perf_counter() - start) / 21
        count = sum(p.numel() for p in model.parameters())
        print(f"{name:<18}{count:>9}{kv_bytes:>18}{identical:>18}"
              f"{losses[0]:>9.3f}{losses[-1]:>9.3f}{seconds:>8.3f}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
