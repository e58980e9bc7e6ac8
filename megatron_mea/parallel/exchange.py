"""Communication volume of MEA's two TP exchanges, and the `auto` choice between them.

Counts are elements one rank sends over the whole forward + backward of one layer (multiply by the
element size for bytes), with direct (pairwise) collectives: an all-to-all sends every chunk but
its own, an all-gather sends the local shard to `t-1` ranks, a reduce-scatter sends `t-1` of its
`t` chunks. `mea-bench-attention` checks these formulas against counted collectives.

Notation (docs/tensor-parallel.md): `N` tokens entering `linear_qkv` (`s*b`, the full sequence also
under SP), `nc` components, `ng` composite K/V heads, `np` query heads, `hn` head dim, `h` hidden
size, `t` TP size.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class ExchangeShape:
    """The sizes of one MEA layer that its communication depends on."""

    num_heads: int  # np
    num_groups: int  # ng
    num_components: int  # nc
    head_dim: int  # hn
    hidden_size: int  # h
    tp_size: int  # t
    bias: bool = False

    @property
    def duplicated(self) -> bool:
        """Fewer components than ranks: every rank holds all of them."""
        return self.num_components < self.tp_size


def activation_exchange_elements(shape: ExchangeShape, num_tokens: int) -> int:
    """`activations` strategy, per micro-batch of `num_tokens` (N divisible by t for exactness).

    Two all-to-alls forward (component heads -> token shards, composite token shards -> heads)
    and their two inverses backward: `4 N hn (nc + ng) (t-1) / t^2`. With duplicated components
    the whole `linear_qkv` output is all-gathered instead: `2 N (np + 2 nc) hn (t-1) / t`.
    """
    t = shape.tp_size
    if t == 1:
        return 0
    hn, nc, ng = shape.head_dim, shape.num_components, shape.num_groups
    if shape.duplicated:
        return 2 * num_tokens * (shape.num_heads + 2 * nc) * hn * (t - 1) // t
    return 4 * num_tokens * hn * (nc + ng) * (t - 1) // (t * t)


def weight_exchange_elements(shape: ExchangeShape) -> int:
    """`weights` strategy, per fold (once per optimizer step with the fold cache).

    All-gather of the K/V rows (bias included) forward, reduce-scatter of their gradient
    backward: `2 (t-1) * 2 nc hn (h + bias) / t`. With duplicated components every row of
    `linear_qkv` is gathered: `2 (t-1) (np + 2 nc) hn (h + bias) / t`.
    """
    t = shape.tp_size
    if t == 1:
        return 0
    columns = shape.hidden_size + int(shape.bias)
    rows = 2 * shape.num_components
    if shape.duplicated:
        rows += shape.num_heads
    return 2 * (t - 1) * rows * shape.head_dim * columns // t


def choose_exchange(shape: ExchangeShape, num_tokens: int) -> str:
    """`auto`: the strategy that sends less for one micro-batch; ties go to `weights`, which also
    skips the activation-sized mixing (so it wins at TP=1, where neither communicates)."""
    weights = weight_exchange_elements(shape)
    activations = activation_exchange_elements(shape, num_tokens)
    return "weights" if weights <= activations else "activations"
