"""The `torch_dist` checkpoints this package writes and reads: layout, tensors, checks, safe
loading (the package docstring of `megatron_mea.checkpoint` lists the modules)."""
