"""The pieces of `mea-gpu-acceptance` (the console script is `megatron_mea.cli.gpu_acceptance`).

- `plans`: sizes and time limits of a GPU run and of the CPU smoke run;
- `environment`: wheels to install at bootstrap, the machine's versions, the GPU's peak;
- `runner`: the steps (environment, GPU tests, training, layer benchmark), each a subprocess;
- `worker`: the training runs, stepped through mea-pretrain's `Trainer` in one subprocess;
- `report`: checks and rates from the raw records, and the text summary.

Every module imports only the standard library at load time: the bootstrap asks for the missing
wheels before megatron-core is installed.
"""
