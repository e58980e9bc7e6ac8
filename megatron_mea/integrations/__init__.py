"""Integrations of megatron_mea with training frameworks.

- `args`: argparse flags generated from `MEATransformerConfig` (no Megatron-LM needed).
- `megatron_lm`: the GPT builder and checkpoint-args restore for Megatron-LM's `pretrain()`;
  the only module that imports `megatron.training`, and only inside the functions that need it.
- `dry_run`: validates a launch script's full argument set without Megatron-LM or a GPU.
- `mlm_flags`: Megatron-LM's flag tables, vendored per tag, and the tag each megatron-core
  release pairs with.
"""
