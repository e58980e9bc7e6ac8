"""The applications, above the library: what a console script in `megatron_mea/cli` runs.

- `training`: `mea-pretrain`, the trainer (arguments, model, loop, run directories, run safety);
- `configs`: small named run configurations (the demo's, the tests' tiny model);
- `demo`, `corpus`: `mea-demo` and the demo-scale dataset it, the sweeps and the reproduction use;
- `sweeps`: `mea-lr-sweep` and `mea-reproduce` (the papers' studies at demo scale);
- `soak`: `mea-soak`, training killed and resumed at random moments;
- `convert`: `mea-convert`'s sub-commands over `megatron_mea.checkpoint`;
- `acceptance`: `mea-gpu-acceptance`, the checks of a lent GPU machine;
- `bench`: `mea-bench-attention`, `mea-bench-decode`, `mea-bench-serve`;
- `evaluation`: `mea-eval`, lm-evaluation-harness over a checkpoint.

The library (everything else under `megatron_mea`) never imports from here
(tests/test_import_graph.py).
"""
