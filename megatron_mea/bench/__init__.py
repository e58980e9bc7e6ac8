"""The pieces of `tools/bench_attention.py` (`megatron_mea.cli.bench_attention`)."""
