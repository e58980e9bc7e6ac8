"""Checkpoint formats and conversions, one subpackage per format; import from the modules.

- `torch_dist/`: the `torch_dist` checkpoints this package writes and reads. `model_only`
  (a model-only checkpoint in `mea-pretrain`'s layout: `ModelDescription`, its models,
  `load_model_weights`), `layerwise` (`write_checkpoint` / `read_checkpoint`: tensors one layer
  at a time), `checks` (finding a checkpoint, refusing one that cannot load; `ConversionError`,
  `CheckpointError`), `integrity` (checksums, pickle scanning), `safe_pickle` (loading without
  running code), `output_dir` (a converter's output: new or empty, renamed at the end).
- `hf/`: Hugging Face checkpoints. `families` (key maps as rule tables), `config` (config.json
  <-> the model description), `importing` (`import_hf_checkpoint`), `exporting`
  (`export_hf_checkpoint`), `files` (safetensors reading and sharded writing, tokenizer files).
- `megatron_lm/`: checkpoints of Megatron-LM's `pretrain_gpt.py`. `reading` (the run its saved
  arguments describe, the types its common state holds), `writing` (the arguments this package
  saves so that Megatron-LM continues from its checkpoints).
- `transforms/`: changes to a model's tensors. `fold` (MEA / KHA maps folded into q/k/v),
  `plugin_params` (the plugin's parameters: upcycling init, folding a layer), `compress` (MEA's
  post-hoc KV compression by SVD, and its per-layer probe).

`mea-convert` (`megatron_mea.cli.convert`) is the command line over them. Nothing of this
package is pickled into a checkpoint (the safe loader admits none of its classes), so moving a
module here does not break checkpoints written before.
"""
