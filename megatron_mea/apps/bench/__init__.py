"""The pieces of the benchmarks: `mea-bench-attention` (`steps`, `collectives`) and
`mea-bench-serve` (`serve_exports`, `serve_rounds`, `serve_report`)."""
