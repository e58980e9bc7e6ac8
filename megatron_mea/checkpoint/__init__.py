"""Checkpoint formats and conversions, one subpackage per format; import from the modules.

- `errors`: the errors every format raises (`CheckpointError`, `ModelMismatchError`,
  `ConversionError`).
- `torch_dist/`: the `torch_dist` checkpoints this package writes and reads. `layout` (the
  directory layout: tracker, `iter_XXXXXXX` names, saved and latest iterations, what is missing,
  the rewind), `model_only` (a model-only checkpoint in `mea-pretrain`'s layout:
  `ModelDescription`, its models, `load_model_weights`), `layerwise` (`write_checkpoint` /
  `read_checkpoint`: tensors one layer at a time), `training_state` (a whole run's checkpoints),
  `checks` (refusing a checkpoint that cannot load), `saved_settings` (what a checkpoint records
  of its run; the refusals of a resume that differs), `integrity` (checksums, pickle scanning),
  `safe_pickle` (loading without running code), `output_dir` (a converter's output: new or
  empty, renamed at the end).
- `hf/`: Hugging Face checkpoints. `families` (key maps as rule tables), `config` (config.json
  <-> the model description), `importing` (`import_hf_checkpoint`), `exporting`
  (`export_hf_checkpoint`), `files` (safetensors reading and sharded writing, tokenizer files).
- `megatron_lm/`: checkpoints of Megatron-LM's `pretrain_gpt.py`, below `torch_dist/` (which
  reads and writes Megatron-LM's arguments through it). `reading` (the run its saved arguments
  describe), `saved_types` (the types its common state holds), `writing` (the arguments this
  package saves so that Megatron-LM continues from its checkpoints).
- `transforms/`: changes to a model's tensors. `fold` (MEA / KHA maps folded into q/k/v),
  `plugin_params` (the plugin's parameters: upcycling init, folding a layer), `compress` (MEA's
  post-hoc KV compression by SVD, and its per-layer probe).

`mea-convert` (`megatron_mea.cli.convert`) is the command line over them. Nothing of this
package is pickled into a checkpoint (the safe loader admits none of its classes), so moving a
module here does not break checkpoints written before.
"""
