"""What `mea-bench-attention` times: one transformer layer, and one step of a small GPT.

Every variant is built from the same seed and shape; only the attention differs (`VARIANTS`).
`args` is the namespace of `megatron_mea.cli.bench_attention`'s parser.
"""

import torch

VARIANTS = {
    "baseline": dict(attention_variant="standard"),
    "mea-activations": dict(attention_variant="mea", mea_mix_init="normal",
                            mea_tp_exchange="activations"),
    "mea-weights": dict(attention_variant="mea", mea_mix_init="normal", mea_tp_exchange="weights"),
    "kha-linear": dict(attention_variant="kha", kha_variant="linear"),
    "kha-linear-folded": dict(attention_variant="kha", kha_variant="linear", kha_fold_linear=True),
    "kha-mlp": dict(attention_variant="kha", kha_variant="mlp"),
}


# The benchmarked shape: `mea-bench-attention`'s flags, named as the `RunArgs` fields they set,
# with their defaults (`ffn_hidden_size` None: 4 * hidden).
SHAPE = {"hidden_size": 1024, "ffn_hidden_size": None, "num_attention_heads": 16,
         "num_query_groups": 4, "seq_length": 2048, "vocab_size": 8192}


def model_args(args, variant, num_layers=1, core_attention="megatron"):
    """The benchmarked model as a `RunArgs`: `args`'s shape (`SHAPE`), a dense GELU GPT
    with RMSNorm and q/k norms, no biases, `variant`'s attention, and the vocabulary unpadded."""
    from megatron_mea.model.args import RunArgs

    return RunArgs(
        num_layers=num_layers,
        **{name: getattr(args, name) for name in SHAPE},
        swiglu=False,
        num_experts=None,
        make_vocab_size_divisible_by=1,
        untie_embeddings_and_output_weights=True,
        bf16=args.bf16,
        transformer_impl="transformer_engine" if args.transformer_engine else "local",
        core_attention=core_attention,
        **VARIANTS[variant],
    )


def make_config(args, variant, tp=1, num_layers=1):
    """The benchmarked model's `MEATransformerConfig`: its architecture through
    `model_args.config_fields`, at TP `tp` (with SP), every fusion off."""
    from megatron_mea import MEATransformerConfig
    from megatron_mea.model.args import config_fields

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    return MEATransformerConfig(
        **config_fields(model_args(args, variant, num_layers)),
        tensor_model_parallel_size=tp,
        sequence_parallel=tp > 1,
        params_dtype=dtype,
        bf16=args.bf16,
        pipeline_dtype=dtype,
        use_cpu_initialization=args.device == "cpu",
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
    )


def build_layer(args, variant, tp=1, core_attention="megatron"):
    from megatron.core.transformer.spec_utils import build_module

    from megatron_mea import get_gpt_layer_spec

    torch.manual_seed(args.seed)
    config = make_config(args, variant, tp)
    spec = get_gpt_layer_spec(config, use_transformer_engine=args.transformer_engine,
                              core_attention=core_attention)
    return build_module(spec, config=config, layer_number=1).to(args.device)


class LayerStep:
    """Forward + backward of one layer on `[s/t, b, h]` (the SP shard) with RoPE and a causal
    mask. `core_attention`: the local spec's (`megatron` or `sdpa`, see `specs.py`)."""

    def __init__(self, args, variant, tp=1, core_attention="megatron"):
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        self.layer = build_layer(args, variant, tp, core_attention)
        config = self.layer.config
        seq = args.seq_length
        dtype = config.params_dtype
        gen = torch.Generator().manual_seed(args.seed)
        shape = (seq // tp, args.micro_batch_size, args.hidden_size)
        self.x = torch.randn(shape, generator=gen).to(args.device, dtype).requires_grad_()
        self.grad = torch.randn(shape, generator=gen).to(args.device, dtype)
        rope = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0)
        self.rotary = rope(seq).to(args.device)

    def __call__(self):
        out, _ = self.layer(self.x, attention_mask=None, rotary_pos_emb=self.rotary)
        out.backward(self.grad)
        self.x.grad = None
        self.layer.zero_grad(set_to_none=True)


class ModelStep:
    """One optimizer step of a small GPT (`megatron_mea.model.gpt.build_model`, fold cache on):
    micro-batches, the fold flush, Adam."""

    def __init__(self, args, variant, core_attention="megatron"):
        from megatron_mea.layers import enable_fold_cache, flush_fold_caches
        from megatron_mea.model import gpt

        torch.manual_seed(args.seed)
        config = make_config(args, variant, num_layers=args.model_layers)
        run = model_args(args, variant, args.model_layers, core_attention)
        self.model = gpt.build_model(run, config, placement="built").to(args.device)
        enable_fold_cache(self.model)
        self.flush = flush_fold_caches
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-5)
        gen = torch.Generator().manual_seed(args.seed)
        shape = (args.model_micro_batches, args.micro_batch_size, args.seq_length + 1)
        tokens = torch.randint(0, args.vocab_size, shape, generator=gen).to(args.device)
        self.inputs, self.labels = tokens[..., :-1], tokens[..., 1:]
        self.positions = torch.arange(args.seq_length, device=args.device).expand_as(self.inputs[0])

    def __call__(self):
        for tokens, labels in zip(self.inputs, self.labels):
            loss = self.model(tokens, self.positions, attention_mask=None, labels=labels)
            loss.float().mean().backward()
        self.flush([self.model])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def layer_flops(args) -> float:
    """Model FLOPs of one baseline layer forward + backward (3x forward; causal attention
    counted as half of the square, as a causal kernel computes it)."""
    h, s, b = args.hidden_size, args.seq_length, args.micro_batch_size
    hn = h // args.num_attention_heads
    qkv = 2 * h * (args.num_attention_heads + 2 * args.num_query_groups) * hn
    attention = 2 * 2 * s * args.num_attention_heads * hn / 2
    proj = 2 * args.num_attention_heads * hn * h
    mlp = 2 * 2 * h * (args.ffn_hidden_size or 4 * h)
    return 3 * s * b * (qkv + attention + proj + mlp)
