"""The pieces of `mea-gpu-acceptance` (the console script is `megatron_mea.cli.gpu_acceptance`).

- `install`: the carried wheels unpacked for this interpreter (no pip, no network);
- `plans`: sizes and time limits of a GPU run and of the CPU smoke run;
- `environment`: the machine's versions, the GPU's peak;
- `runner`: the steps (environment, GPU tests, training, decode benchmark, Megatron-LM's loop,
  layer benchmark), each a subprocess, under one time budget;
- `worker`: the training runs, stepped through mea-pretrain's `Trainer` in one subprocess;
- `megatron_lm`: the step that runs Megatron-LM's own `pretrain_gpt.py`;
- `report`: checks and rates from the raw records, and the text summary;
- `pack`: the report folder packed into at most four files;
- `session`: one run, from the report folder through the steps to the packed report.

Every module imports only the standard library at load time: the bootstrap installs the wheels
before megatron-core is there.
"""
