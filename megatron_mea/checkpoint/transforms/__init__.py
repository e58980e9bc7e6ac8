"""Changes to a model's tensors between checkpoints: folding, the plugin parameters' upcycling
init, MEA's SVD compression (the package docstring of `megatron_mea.checkpoint`)."""
