"""The benchmarks: `mea-bench-attention` (`attention`: the rounds and the table; `steps`,
`collectives`), `mea-bench-decode` (`decode`) and `mea-bench-serve` (`serve`: the rounds;
`serve_exports`, `serve_rounds`, `serve_report`)."""
