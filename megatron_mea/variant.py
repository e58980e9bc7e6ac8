"""The attention-variant settings, declared once.

`AttentionVariantFields` is the one declaration of every MEA / KHA setting: its name, type,
choices (the `Literal` annotations), default and meaning. Everything else is derived from it:
`MEATransformerConfig` inherits the fields (and validates them), `mea-pretrain`'s flags and YAML
keys are generated from them, the model-size arithmetic inherits them, and the converters and the
Hugging Face export copy the fields whose `scope` is `"model"`.

Pure Python (no torch, no Megatron), so that every tool can import it.

Each field's `metadata["scope"]` says what it changes:
- `"model"`: the function and the parameters (saved with exported models);
- `"init"`: only the initial values of the parameters;
- `"training"`: only how training computes the same function (exchange, folding).
"""

import ast
import dataclasses
import inspect
import typing
from dataclasses import dataclass, field
from typing import Literal, Optional, Tuple

AttentionVariant = Literal["standard", "mea", "kha"]
KHATarget = Literal["q", "k", "v"]


def _scoped(default, scope: str):
    return field(default=default, metadata={"scope": scope})


@dataclass
class AttentionVariantFields:
    """The MEA / KHA settings (Megatron's notation: `np` = num_attention_heads, `ng` =
    num_query_groups, `hn` = kv_channels, `t` = tensor_model_parallel_size)."""

    attention_variant: AttentionVariant = _scoped("standard", "model")
    """Self-attention flavour: plain Megatron attention, MEA (head-level linear composition of K/V
    plus a per-head RMS norm) or KHA (a shared per-head transform of Q/K/V)."""

    attention_variant_per_layer: Optional[Tuple[AttentionVariant, ...]] = _scoped(None, "model")
    """One variant per layer, overriding `attention_variant` (e.g. a compressed model whose
    uncompressed layers stay standard attention). The MEA / KHA fields apply to the layers of
    their variant."""

    mea_num_kv_components: Optional[int] = _scoped(None, "model")
    """MEA: number of component K/V heads `nc` that `linear_qkv` produces and the KV cache stores;
    HLC rebuilds the `ng` composite heads from them. Default `ng`; `nc < ng` gives virtual heads
    (KV cache `nc/ng` of GQA's). Must divide `np` and be a multiple or a divisor of `t` (with
    `nc < t` every rank computes and caches all components)."""

    mea_num_kv_components_per_layer: Optional[Tuple[int, ...]] = _scoped(None, "model")
    """MEA: one `nc` per layer (e.g. after compressing only some layers post hoc), overriding
    `mea_num_kv_components`; each entry obeys the same rules (entries of non-MEA layers are
    ignored)."""

    mea_hlc: bool = _scoped(True, "model")
    """MEA: head-level composition of K/V (the `head_mix` matrices). False keeps only the head norm
    (the "+norm" control of the MEA paper; needs `nc == ng`)."""

    mea_head_norm: bool = _scoped(True, "model")
    """MEA: RMS-normalise each query head's attention output over its `hn` channels (learnable scale
    per head and channel, eps = layernorm_epsilon) before `linear_proj`."""

    mea_key_norm_before_mix: bool = _scoped(False, "model")
    """MEA with a k norm (`qk_layernorm`): normalise each component key head, then mix
    (norm-then-mix), instead of mixing and normalising each composite key (mix-then-norm, the
    default and the MEA paper's order). A different function: the composite keys are linear in
    the cached normed components, so stock multi-query attention over the components serves
    them with no per-key scale (vLLM's component cache). Refuses `mea_tp_exchange='weights'`
    and makes `auto` exchange activations (a norm between the projection and the mix does not
    fold into the weights)."""

    mea_mix_init: Optional[Literal["identity", "repeat", "normal"]] = _scoped(None, "init")
    """MEA: initial mixing matrices `[nc, ng]`. Default by shape: `identity` when `nc == ng`,
    `repeat` (composite h copies component `h * nc // ng`, i.e. GQA with nc groups) otherwise.
    `normal` draws N(0, 1/nc)."""

    mea_tp_exchange: Literal["activations", "weights", "auto"] = _scoped("activations", "training")
    """MEA under tensor parallelism (training forwards; evaluation and decoding always mix the
    cached components). `activations` trades the head shard of K/V for a token shard with one
    all-to-all, mixes, and trades back (per micro-batch). `weights` folds HLC into the K/V rows of
    `linear_qkv` (all-gather of those rows, reduce-scatter of their gradient; once per optimizer
    step with `megatron_mea.layers.enable_fold_cache`). `auto` takes, per micro-batch, whichever
    sends fewer elements. All three compute the same model."""

    kha_variant: Optional[Literal["linear", "mlp", "gate"]] = _scoped(None, "model")
    """KHA: `linear` (a shared `hn x hn` matrix per target), `mlp` (a shared gated MLP per
    target, `2 * ((x W_up) * sigmoid(x W_gate)) W_down`) or `gate` (the gate alone,
    `2 * x * sigmoid(x W_gate)`: the KHA paper's gate-only ablation). Default by model,
    following the KHA paper's ablations: `mlp` for MoE models, `linear` for dense ones and with
    MLA (`default_kha_variant`)."""

    kha_targets: Optional[Tuple[KHATarget, ...]] = _scoped(None, "model")
    """KHA: which of q, k, v are transformed. Default ("q", "k", "v") for `linear`, ("v",) for
    `mlp` and `gate` (the paper's main setting; its ablations also put the MLP on q, on k and on
    q, k and v)."""

    kha_init: Literal["identity", "random"] = _scoped("identity", "init")
    """KHA: initial matrices. `identity` (the paper's): identity matrices and a zero gate, so a
    fresh layer computes the baseline. `random` (the paper's Section 3.3 ablation): every matrix
    drawn from N(0, 1/hn)."""

    kha_fold_linear: bool = _scoped(False, "training")
    """KHA-Linear: fold the matrices into the rows of `linear_qkv` (`T^T W` per head) and project
    once, instead of transforming the projected heads (an exact reparametrisation of the same
    computation, without the per-token matmuls)."""

    def variant_of(self, layer_number: int) -> str:
        """The attention variant of layer `layer_number`: the one answer, for the config, the
        specs, the size accounting and the converters. 1-based and global, as Megatron numbers
        layers (0-based callers pass `layer + 1`); MTP layers, numbered after the decoder's, take
        `attention_variant`."""
        per_layer = self.attention_variant_per_layer
        if per_layer is None or not 1 <= layer_number <= len(per_layer):
            return self.attention_variant
        return per_layer[layer_number - 1]

    def variants_in_use(self) -> set:
        """The variants some layer uses."""
        return set(self.attention_variant_per_layer or (self.attention_variant,))

    def resolve_variant_defaults(
        self, num_query_groups: int, moe: bool, multi_latent_attention: bool = False
    ) -> None:
        """Fill the defaults that depend on the model (`None` fields), in place."""
        in_use = self.variants_in_use()
        if "mea" in in_use and self.mea_num_kv_components is None:
            self.mea_num_kv_components = num_query_groups
        if "kha" in in_use:
            if self.kha_variant is None:
                self.kha_variant = default_kha_variant(moe, multi_latent_attention)
            if self.kha_targets is None:
                self.kha_targets = default_kha_targets(self.kha_variant)


# The `[hn, hn]` matrices of one KHA target, by `kha_variant`, in the order the transform takes
# them (`ops.functional.kha_transform`); target `t`'s parameters are named `f"{t}_{name}"`
# (`q_weight`, `v_up`, `v_gate`...).
KHA_MATRICES = {"linear": ("weight",), "mlp": ("up", "gate", "down"), "gate": ("gate",)}


def default_kha_variant(moe: bool, multi_latent_attention: bool = False) -> str:
    """KHA paper: the MLP variant helps MoE models most, the linear one dense models; on MLA
    only the linear one works."""
    return "mlp" if moe and not multi_latent_attention else "linear"


def default_kha_targets(kha_variant: str) -> Tuple[str, ...]:
    return choices("kha_targets") if kha_variant == "linear" else ("v",)


VARIANT_FIELDS = tuple(f.name for f in dataclasses.fields(AttentionVariantFields))


def fields_of_scope(*scopes: str) -> Tuple[str, ...]:
    """Names of the variant fields whose scope is one of `scopes` (`model`, `init`, `training`)."""
    return tuple(
        f.name for f in dataclasses.fields(AttentionVariantFields) if f.metadata["scope"] in scopes
    )


def variant_settings(source, scopes=("model", "init", "training")) -> dict:
    """`{name: value}` of the variant fields (of `scopes`) read from any object with them as
    attributes (arguments, a config, an HF config); tuples for the sequence-valued ones."""
    values = {}
    for name in fields_of_scope(*scopes):
        value = getattr(source, name, None)
        values[name] = tuple(value) if isinstance(value, list) else value
    return values


def choices(name: str) -> Tuple:
    """The allowed values of a variant field (or of its entries, for per-layer / target tuples),
    read from its `Literal` annotation; () if it has none."""
    annotation = typing.get_type_hints(AttentionVariantFields)[name]
    while True:
        if typing.get_origin(annotation) is Literal:
            return typing.get_args(annotation)
        inner = [a for a in typing.get_args(annotation) if a not in (type(None), Ellipsis)]
        if not inner:
            return ()
        annotation = inner[0]


def field_help(name: str) -> str:
    """The docstring of variant field `name` (the string right after its declaration), on one
    line: the help text of its command-line flags."""
    return attribute_docs(AttentionVariantFields).get(name, "")


def attribute_docs(cls: type) -> dict:
    """`{field: docstring}` of a dataclass `cls` (the string literal right after each annotated
    field, whitespace folded), read from its source."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(inspect.cleandoc(nxt.value.value).split())
    return docs
