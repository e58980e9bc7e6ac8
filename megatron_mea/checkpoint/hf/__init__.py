"""Hugging Face checkpoints <-> `torch_dist` checkpoints: family key maps, config translation,
import, export (the package docstring of `megatron_mea.checkpoint` lists the modules)."""
