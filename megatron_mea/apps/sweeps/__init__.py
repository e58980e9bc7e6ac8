"""Learning-rate sweeps (`sweep`: the grid and its fit; `runs`: one training run per point;
`fit`: the loss-vs-rate fit) behind `mea-lr-sweep` and `mea-reproduce`."""
