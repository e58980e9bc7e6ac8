"""The applications, above the library: what a console script in `megatron_mea/cli` runs.

- `training`: `mea-pretrain`, the trainer (arguments, model, loop, checkpoints, run safety);
- `demo`: `mea-demo`, the small MoE GPT trained with each variant on CPU;
- `sweeps`: `mea-lr-sweep`'s learning-rate sweeps and `mea-reproduce`'s papers' studies at demo
  scale;
- `acceptance`: `mea-gpu-acceptance`, the checks of a lent GPU machine;
- `bench`: the attention, decode and serving benchmarks;
- `soak`: `mea-soak`, training killed at random moments and resumed;
- `convert`: `mea-convert`'s sub-commands over `megatron_mea.checkpoint`;
- `evaluation`: `mea-eval`, lm-evaluation-harness over a checkpoint;
- `configs` (the named small configs: the demo's, the tests' tiny model) and `corpus` (the
  demo-scale dataset), shared by the tools and the tests.

The library (everything else under `megatron_mea`) never imports from here
(tests/test_import_graph.py).
"""
