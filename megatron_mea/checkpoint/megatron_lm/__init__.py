"""Checkpoints of Megatron-LM's `pretrain_gpt.py`: reading the run its saved arguments describe,
and writing the arguments it expects (the package docstring of `megatron_mea.checkpoint`).
Below `torch_dist/`: nothing here imports it (the directory layout is its caller's)."""
