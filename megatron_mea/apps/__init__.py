"""The applications, above the library: what a console script in `megatron_mea/cli` runs.

- `training`: `mea-pretrain`, the trainer (arguments, model, loop, checkpoints, run safety);
- `sweeps`: learning-rate sweeps and the papers' reproduction at demo scale;
- `acceptance`: `mea-gpu-acceptance`, the checks of a lent GPU machine;
- `bench`: the pieces of the attention and serving benchmarks;
- `evaluation`: `mea-eval`, lm-evaluation-harness over a checkpoint.

The library (everything else under `megatron_mea`) never imports from here
(tests/test_import_graph.py).
"""
