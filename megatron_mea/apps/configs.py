"""Small named run configurations, for the tools and the tests alike (torchtitan keeps its
`llama3_debugmodel` the same way).

Each is a dict of `mea-pretrain` settings keyed by argument name, as a `--config` YAML file
holds them (`megatron_mea.model.run_config`); `flags` writes one as command-line flags.

- `DEMO`: the CPU-sized MoE GPT that `make demo`, the learning-rate sweep and the reproduction
  train (4 layers, 2 of them MoE; 8 query heads in 4 KV groups; 4 experts, top-2).
- `TINY`: the tests' model (2 layers, both MoE with 4 experts; 4 heads in 2 groups; sequences of
  32), evaluated and logged only at the end of a short run: small enough that a test trains it
  in seconds on one CPU core.
"""

from typing import List

DEMO = {
    "num_layers": 4,
    "hidden_size": 128,
    "ffn_hidden_size": 256,
    "num_attention_heads": 8,
    "num_query_groups": 4,
    "seq_length": 128,
    "num_experts": 4,
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": 128,
    "moe_layer_freq": 2,
    "moe_aux_loss_coeff": 0.01,
    "micro_batch_size": 8,
    "global_batch_size": 16,
    "train_iters": 300,
    "lr": 2e-3,
    "min_lr": 2e-4,
    "lr_warmup_fraction": 0.05,
    "weight_decay": 0.1,
    "clip_grad": 1.0,
    "seed": 1234,
    "split": "98,2,0",
    "tokenizer_type": "ByteLevelTokenizer",
    "eval_interval": 50,
    "eval_iters": 4,
    "log_interval": 50,
    "save_interval": 150,
}

TINY = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "seq_length": 32,
    "num_experts": 4,
    "moe_ffn_hidden_size": 64,
    "micro_batch_size": 4,
    "global_batch_size": 8,
    "eval_interval": 1000,
    "eval_iters": 1,
    "log_interval": 1000,
    "no_progress_bar": True,
}


def flags(config: dict, **overrides) -> List[str]:
    """`config` with `overrides` (same keys; a value of None drops the key) as `mea-pretrain`
    flags: `{"num_layers": 2}` -> `["--num-layers", "2"]`; True -> the bare flag, False -> none."""
    merged = {**config, **overrides}
    argv: List[str] = []
    for name, value in merged.items():
        flag = "--" + name.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        else:
            argv += [flag, str(value)]
    return argv
