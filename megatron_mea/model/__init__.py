"""The model: its description and its build.

- `args`: `ModelArgs` / `RunArgs`, the architecture and run fields, each declared once, and their
  translations (config fields, GPTModel arguments, parallel sizes);
- `size`: parameter and FLOP accounting from the same description;
- `run_config`: the description saved beside a checkpoint and read back;
- `gpt`: the one GPT builder (config, spec, GPTModel) for every tool;
- `fusions`: which fused kernels a build may use on this machine.

The public config and specs (`MEATransformerConfig`, `get_gpt_decoder_block_spec`) stay at the
package root; the attention variant's fields are `megatron_mea.variant`.
"""
