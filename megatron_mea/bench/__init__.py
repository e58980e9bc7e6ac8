"""The pieces of `mea-bench-attention` (`megatron_mea.cli.bench_attention`)."""
