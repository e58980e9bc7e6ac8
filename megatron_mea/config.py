"""`MEATransformerConfig`: Megatron's `TransformerConfig` plus the MEA / KHA fields.

Every user mistake is caught here, in `__post_init__`, with a `ValueError` that names the field and
the sizes involved, so that nothing fails later as an assert deep inside a forward pass.
"""

import logging
from dataclasses import dataclass
from typing import Literal, Optional, Tuple

from megatron.core.transformer.transformer_config import TransformerConfig

logger = logging.getLogger(__name__)

ATTENTION_VARIANTS = ("standard", "mea", "kha")
MEA_MIX_INITS = ("identity", "repeat", "normal")
MEA_TP_EXCHANGES = ("activations", "weights", "auto")
KHA_VARIANTS = ("linear", "mlp")
KHA_TARGETS = ("q", "k", "v")

# Megatron features that bypass the Python q/k/v path the variants hook into, or that change the
# attention module altogether. Each maps to the reason shown to the user.
_UNSUPPORTED_WITH_VARIANTS = {
    "fused_single_qkv_rope": "it skips the q/k/v split the variants act on",
    "flash_decode": "its GPU kernel path skips the variants' KV-cache handling",
    "fp8_multi_head_attention": "it hands FP8 tensors to the plugin's bf16 ops",
    "multi_latent_attention": "MLA has its own attention module (use attention_variant='standard')",
    "attention_output_gate": "the gated output path is not supported by the variants yet",
}


@dataclass
class MEATransformerConfig(TransformerConfig):
    """Transformer config with the cross-head attention variants of megatron_mea.

    Sizes use Megatron's notation: `np` = num_attention_heads, `ng` = num_query_groups,
    `hn` = kv_channels, `t` = tensor_model_parallel_size.
    """

    attention_variant: Literal["standard", "mea", "kha"] = "standard"
    """Self-attention flavour: plain Megatron attention, MEA (head-level linear composition of K/V
    plus a per-head RMS norm) or KHA (a shared per-head transform of Q/K/V)."""

    mea_num_kv_components: Optional[int] = None
    """MEA: number of component K/V heads `nc` that `linear_qkv` produces and the KV cache stores;
    HLC rebuilds the `ng` composite heads from them. Default `ng`; `nc < ng` gives virtual heads
    (KV cache `nc/ng` of GQA's). Must divide `np` and be a multiple or a divisor of `t` (with
    `nc < t` every rank computes and caches all components)."""

    mea_num_kv_components_per_layer: Optional[Tuple[int, ...]] = None
    """MEA: one `nc` per layer (e.g. after compressing only some layers post hoc), overriding
    `mea_num_kv_components`; each entry obeys the same rules."""

    mea_mix_init: Optional[Literal["identity", "repeat", "normal"]] = None
    """MEA: initial mixing matrices `[nc, ng]`. Default by shape: `identity` when `nc == ng`,
    `repeat` (composite h copies component `h * nc // ng`, i.e. GQA with nc groups) otherwise.
    `normal` draws N(0, 1/nc)."""

    mea_head_norm: bool = True
    """MEA: RMS-normalise each query head's attention output over its `hn` channels (learnable scale
    per head and channel, eps = layernorm_epsilon) before `linear_proj`."""

    mea_tp_exchange: Literal["activations", "weights", "auto"] = "activations"
    """MEA under tensor parallelism (training forwards; evaluation and decoding always mix the
    cached components). `activations` trades the head shard of K/V for a token shard with one
    all-to-all, mixes, and trades back (per micro-batch). `weights` folds HLC into the K/V rows of
    `linear_qkv` (all-gather of those rows, reduce-scatter of their gradient; once per optimizer
    step with `megatron_mea.layers.enable_fold_cache`). `auto` takes, per micro-batch, whichever
    sends fewer elements (`megatron_mea.parallel.exchange`). All three compute the same model."""

    kha_variant: Optional[Literal["linear", "mlp"]] = None
    """KHA: `linear` (a shared `hn x hn` matrix per target) or `mlp` (gated MLP on V only).
    Default by model, following the KHA paper's ablations: `mlp` for MoE models, `linear` for dense."""

    kha_targets: Optional[tuple] = None
    """KHA: which of q, k, v are transformed. Default ("q", "k", "v") for `linear`, ("v",) for
    `mlp` (the only allowed value there)."""

    kha_fold_linear: bool = False
    """KHA-Linear: fold the matrices into the rows of `linear_qkv` (`T^T W` per head) and project
    once, instead of transforming the projected heads (an exact reparametrisation of the same
    computation, without the per-token matmuls; once per optimizer step with
    `megatron_mea.layers.enable_fold_cache`)."""

    def __post_init__(self):
        if self.attention_variant not in ATTENTION_VARIANTS:
            raise ValueError(
                f"attention_variant ({self.attention_variant!r}) must be one of {ATTENTION_VARIANTS}"
            )
        if self.attention_variant != "standard":
            # Before Megatron's own checks, so the user hears about the variant conflict first.
            self._check_unsupported_features()
        if self.attention_variant == "mea":
            self._check_tp_exchange()
        if self.attention_variant == "kha" and self.kha_fold_linear:
            self._check_folded_projection("kha_fold_linear=True")
        super().__post_init__()
        self._check_head_counts()
        if self.attention_variant == "standard":
            self._warn_ignored_fields()
            return
        self._check_tensor_parallel_groups()
        if self.attention_variant == "mea":
            self._check_mea()
        else:
            self._check_kha()

    # ---- validation, one method per group of fields ------------------------------------------

    def _check_head_counts(self):
        # Megatron accepts these and fails later inside a layer constructor.
        np_, ng = self.num_attention_heads, self.num_query_groups
        if ng < 1 or np_ % ng:
            raise ValueError(
                f"num_query_groups ({ng}) must be a positive divisor of num_attention_heads ({np_})"
            )

    def _warn_ignored_fields(self):
        set_fields = [
            name
            for name, default in (
                ("mea_num_kv_components", None),
                ("mea_num_kv_components_per_layer", None),
                ("mea_mix_init", None),
                ("kha_variant", None),
                ("kha_targets", None),
                ("kha_fold_linear", False),
            )
            if getattr(self, name) != default
        ]
        if set_fields:
            logger.warning(
                "attention_variant='standard' ignores %s", ", ".join(set_fields)
            )

    def _check_unsupported_features(self):
        for name, why in _UNSUPPORTED_WITH_VARIANTS.items():
            if getattr(self, name, False):
                raise ValueError(
                    f"{name}=True is not supported with attention_variant="
                    f"'{self.attention_variant}': {why}"
                )
        if self.experimental_attention_variant is not None:
            raise ValueError(
                f"experimental_attention_variant ({self.experimental_attention_variant!r}) cannot "
                f"be combined with attention_variant='{self.attention_variant}'"
            )

    def _check_tensor_parallel_groups(self):
        t = self.tensor_model_parallel_size
        if self.num_query_groups % t != 0:
            raise ValueError(
                f"num_query_groups ({self.num_query_groups}) must be divisible by "
                f"tensor_model_parallel_size ({t}) with attention_variant="
                f"'{self.attention_variant}' (KV groups shared by several TP ranks are not "
                "supported)"
            )

    def _check_mea(self):
        ng = self.num_query_groups
        if self.mea_num_kv_components is None:
            self.mea_num_kv_components = ng
        self._check_components("mea_num_kv_components", self.mea_num_kv_components)
        per_layer = self.mea_num_kv_components_per_layer
        if per_layer is not None:
            per_layer = tuple(per_layer)
            if len(per_layer) != self.num_layers:
                raise ValueError(
                    f"mea_num_kv_components_per_layer has {len(per_layer)} entries, "
                    f"num_layers is {self.num_layers}"
                )
            for nc in sorted(set(per_layer), key=str):
                self._check_components("mea_num_kv_components_per_layer", nc)
            self.mea_num_kv_components_per_layer = per_layer
            # Megatron stacks each tensor of all layers under one key, which needs one shape;
            # with per-layer shapes, checkpoint every layer under its own key instead.
            self.hetereogenous_dist_checkpoint = True
        counts = set(per_layer or (self.mea_num_kv_components,))
        if self.mea_mix_init is None:
            # `repeat` is the identity wherever nc == ng.
            self.mea_mix_init = "identity" if counts == {ng} else "repeat"
        if self.mea_mix_init not in MEA_MIX_INITS:
            raise ValueError(f"mea_mix_init ({self.mea_mix_init!r}) must be one of {MEA_MIX_INITS}")
        if self.mea_mix_init == "identity" and counts != {ng}:
            nc = min(counts)
            raise ValueError(
                f"mea_mix_init='identity' needs mea_num_kv_components ({nc}) == num_query_groups "
                f"({ng}); use 'repeat' or 'normal'"
            )

    def _check_tp_exchange(self):
        if self.mea_tp_exchange not in MEA_TP_EXCHANGES:
            raise ValueError(
                f"mea_tp_exchange ({self.mea_tp_exchange!r}) must be one of {MEA_TP_EXCHANGES}"
            )
        if self.mea_tp_exchange != "activations":
            self._check_folded_projection(f"mea_tp_exchange={self.mea_tp_exchange!r}")

    def _check_folded_projection(self, setting):
        # A folded projection hands linear_qkv a computed weight with its own shape. Deferred
        # weight gradients would land on the parameter's `.grad` later (wrong shape, fold
        # skipped), and a captured CUDA graph would keep the first step's weight.
        conflicts = {
            "delay_wgrad_compute": self.delay_wgrad_compute,
            "enable_cuda_graph": self.enable_cuda_graph,
            "external_cuda_graph": self.external_cuda_graph,
            "cuda_graph_impl": self.cuda_graph_impl != "none",
        }
        for name, on in conflicts.items():
            if on:
                raise ValueError(
                    f"{setting} cannot be combined with {name}={getattr(self, name)!r} (the "
                    "folded linear_qkv weight is rebuilt every step)"
                )

    def _check_components(self, name, nc):
        np_, ng, t = self.num_attention_heads, self.num_query_groups, self.tensor_model_parallel_size
        if not isinstance(nc, int) or isinstance(nc, bool) or nc < 1:
            raise ValueError(f"{name} ({nc}) must be a positive integer")
        if nc > ng:
            raise ValueError(
                f"{name} ({nc}) must not exceed num_query_groups ({ng}): components are "
                "compressed heads"
            )
        if np_ % nc != 0:
            raise ValueError(
                f"{name} ({nc}) must divide num_attention_heads ({np_}): linear_qkv lays out "
                "query heads per component group"
            )
        if nc % t and t % nc:
            raise ValueError(
                f"{name} ({nc}) must be a multiple or a divisor of tensor_model_parallel_size "
                f"({t}): each TP rank holds nc/t component heads, or all of them when nc < t"
            )
        if nc < t and (2 * nc * self.kv_channels) % t:
            raise ValueError(
                f"{name} ({nc}) x 2 x kv_channels ({self.kv_channels}) must be divisible by "
                f"tensor_model_parallel_size ({t}) to shard linear_qkv's rows"
            )

    def kv_components(self, layer_number: int) -> int:
        """MEA's `nc` of layer `layer_number` (1-based, global, as Megatron numbers layers)."""
        per_layer = self.mea_num_kv_components_per_layer
        if per_layer is None:
            return self.mea_num_kv_components
        if not 1 <= layer_number <= len(per_layer):
            raise ValueError(
                f"mea_num_kv_components_per_layer has {len(per_layer)} entries, no entry for "
                f"layer {layer_number} (MTP layers need mea_num_kv_components)"
            )
        return per_layer[layer_number - 1]

    def _check_kha(self):
        if self.kha_variant is None:
            self.kha_variant = "mlp" if self.num_moe_experts else "linear"
        if self.kha_variant not in KHA_VARIANTS:
            raise ValueError(f"kha_variant ({self.kha_variant!r}) must be one of {KHA_VARIANTS}")
        if self.kha_targets is None:
            self.kha_targets = ("v",) if self.kha_variant == "mlp" else KHA_TARGETS
        if isinstance(self.kha_targets, str):
            raise ValueError(
                f"kha_targets ({self.kha_targets!r}) must be a tuple such as ('q', 'k', 'v')"
            )
        targets = tuple(self.kha_targets)
        unknown = [x for x in targets if x not in KHA_TARGETS]
        if not targets or unknown or len(set(targets)) != len(targets):
            raise ValueError(
                f"kha_targets ({targets}) must be a non-empty subset of {KHA_TARGETS} without "
                "repeats"
            )
        if self.kha_variant == "mlp" and targets != ("v",):
            raise ValueError(
                f"kha_targets ({targets}) must be ('v',) with kha_variant='mlp': the KHA MLP acts "
                "on values only"
            )
        # Canonical order, so that parameter creation (and checkpoints) do not depend on it.
        self.kha_targets = tuple(x for x in KHA_TARGETS if x in targets)
        if self.kha_fold_linear and self.kha_variant != "linear":
            raise ValueError(
                f"kha_fold_linear=True needs kha_variant='linear' (got {self.kha_variant!r}): "
                "the KHA MLP is not linear and does not fold"
            )
