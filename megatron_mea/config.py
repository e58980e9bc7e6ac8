"""`MEATransformerConfig`: Megatron's `TransformerConfig` plus the MEA / KHA fields.

Every user mistake is caught here, in `__post_init__`, with a `ValueError` that names the field and
the sizes involved, so that nothing fails later as an assert deep inside a forward pass.
"""

import logging
from dataclasses import dataclass

from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_mea.variant import (
    AttentionVariantFields,
    choices,
    default_kha_variant,
    fields_of_scope,
)

logger = logging.getLogger(__name__)

ATTENTION_VARIANTS = choices("attention_variant")
MEA_MIX_INITS = choices("mea_mix_init")
MEA_TP_EXCHANGES = choices("mea_tp_exchange")
KHA_VARIANTS = choices("kha_variant")
KHA_TARGETS = choices("kha_targets")
KHA_INITS = choices("kha_init")

# Megatron features that bypass the Python q/k/v path the variants hook into, or that change the
# attention module altogether. Each maps to the reason shown to the user.
_UNSUPPORTED_WITH_VARIANTS = {
    "fused_single_qkv_rope": "it skips the q/k/v split the variants act on",
    "flash_decode": "its GPU kernel path skips the variants' KV-cache handling",
    "fp8_multi_head_attention": "it hands FP8 tensors to the plugin's bf16 ops",
    "attention_output_gate": "the gated output path is not supported by the variants yet",
}


@dataclass
class MEATransformerConfig(AttentionVariantFields, TransformerConfig):
    """Transformer config with the cross-head attention variants of megatron_mea.

    The variant fields are declared (with their meaning) in `megatron_mea.variant`; this class
    validates them against the model. Sizes use Megatron's notation: `np` = num_attention_heads,
    `ng` = num_query_groups, `hn` = kv_channels, `t` = tensor_model_parallel_size.
    """

    def __post_init__(self):
        self._check_variant_names()
        in_use = self.variants_in_use() - {"standard"}
        if in_use:
            # Before Megatron's own checks, so the user hears about the variant conflict first.
            self._check_unsupported_features()
        if "mea" in in_use:
            self._check_tp_exchange()
        if "kha" in in_use and self.kha_fold_linear:
            self._check_folded_projection("kha_fold_linear=True")
        super().__post_init__()
        self._check_head_counts()
        if not in_use:
            self._warn_ignored_fields()
            return
        self._check_tensor_parallel_groups()
        if self.attention_variant_per_layer and len(set(self.attention_variant_per_layer)) > 1:
            # Megatron stacks each tensor of all layers under one key, which needs one shape;
            # with per-layer modules, checkpoint every layer under its own key instead.
            self.hetereogenous_dist_checkpoint = True
        self.resolve_variant_defaults(
            self.num_query_groups,
            moe=bool(self.num_moe_experts),
            multi_latent_attention=self.multi_latent_attention,
        )
        if "mea" in in_use:
            self._check_mea()
        else:
            self._check_kha()

    # ---- validation, one method per group of fields ------------------------------------------

    def _check_variant_names(self):
        if self.attention_variant not in ATTENTION_VARIANTS:
            raise ValueError(
                f"attention_variant ({self.attention_variant!r}) must be one of {ATTENTION_VARIANTS}"
            )
        per_layer = self.attention_variant_per_layer
        if per_layer is None:
            return
        if isinstance(per_layer, str):
            raise ValueError(
                f"attention_variant_per_layer ({per_layer!r}) must be a sequence with one variant "
                "per layer"
            )
        per_layer = self.attention_variant_per_layer = tuple(per_layer)
        if len(per_layer) != self.num_layers:
            raise ValueError(
                f"attention_variant_per_layer has {len(per_layer)} entries, num_layers is "
                f"{self.num_layers}"
            )
        unknown = sorted({v for v in per_layer if v not in ATTENTION_VARIANTS}, key=str)
        if unknown:
            raise ValueError(
                f"attention_variant_per_layer: {unknown} not in {ATTENTION_VARIANTS}"
            )
        variants = set(per_layer) - {"standard"}
        if len(variants) > 1 or (variants and variants != {self.attention_variant}):
            # The model-wide settings (TP exchange, folding, KV cache, HF export) follow
            # `attention_variant`; mixing MEA and KHA layers would need two of each.
            raise ValueError(
                f"attention_variant_per_layer mixes {sorted(set(per_layer))}: its layers must be "
                f"'standard' or attention_variant ({self.attention_variant!r})"
            )

    def _check_head_counts(self):
        # Megatron accepts these and fails later inside a layer constructor.
        np_, ng = self.num_attention_heads, self.num_query_groups
        if ng < 1 or np_ % ng:
            raise ValueError(
                f"num_query_groups ({ng}) must be a positive divisor of num_attention_heads ({np_})"
            )

    def _warn_ignored_fields(self):
        defaults = AttentionVariantFields()
        set_fields = [
            name
            for name in fields_of_scope("model", "init", "training")
            if name != "attention_variant"
            and getattr(self, name) not in (None, False, getattr(defaults, name))
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
        if self.multi_latent_attention:
            self._check_multi_latent_attention()
        if self.experimental_attention_variant is not None:
            raise ValueError(
                f"experimental_attention_variant ({self.experimental_attention_variant!r}) cannot "
                f"be combined with attention_variant='{self.attention_variant}'"
            )

    def _check_multi_latent_attention(self):
        # Only KHA-Linear has an MLA module (layers/kha_mla.py): it folds into MLA's
        # up-projections, so MLA's latent KV cache and absorbed decoding stay exact.
        variant = f"attention_variant='{self.attention_variant}'"
        if "mea" in self.variants_in_use():
            raise ValueError(
                f"multi_latent_attention=True is not supported with {variant}: MEA composes "
                "whole K/V heads from cached component heads, but MLA caches one shared latent "
                "and builds every head from it, so a head-level composition is only a "
                "reparametrisation of linear_kv_up_proj and there are no component heads to "
                "cache (and MLA has no linear_qkv for MEA's split)"
            )
        kha_variant = self.kha_variant or default_kha_variant(
            bool(self.num_moe_experts), multi_latent_attention=True
        )
        if kha_variant != "linear":
            raise ValueError(
                f"multi_latent_attention=True needs kha_variant='linear' with {variant} (got "
                f"{kha_variant!r}): "
                "the KHA paper reports that only the linear variant works on MLA. The MLP is "
                "not linear in the latent, so it cannot fold into linear_kv_up_proj: every "
                "cached token's value head would have to be rebuilt, which defeats MLA's "
                "latent KV cache and its absorbed decoding"
            )
        if self.kha_init != "identity":
            raise ValueError(
                f"kha_init ({self.kha_init!r}) is not supported with multi_latent_attention=True: "
                "the MLA module starts from the identity only"
            )
        if self.kha_fold_linear:
            raise ValueError(
                "kha_fold_linear=True is not supported with multi_latent_attention=True: it "
                "folds into linear_qkv, which MLA does not have"
            )
        if getattr(self, "cache_mla_latents", False):
            raise ValueError(
                f"cache_mla_latents=True is not supported with {variant}: the absorbed latent "
                "path does not build the per-head K/V that KHA transforms"
            )
        t = self.tensor_model_parallel_size
        if t > 1 and not self.sequence_parallel:
            raise ValueError(
                f"multi_latent_attention=True with {variant} and tensor_model_parallel_size "
                f"({t}) > 1 needs sequence_parallel=True: Megatron's MLA sums the gradient of "
                "the RoPE key shared by all heads (and of its duplicated down-projections) over "
                "the TP ranks only in the sequence-parallel gather"
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
        self._check_components("mea_num_kv_components", self.mea_num_kv_components)
        per_layer = self.mea_num_kv_components_per_layer
        if per_layer is not None:
            per_layer = self.mea_num_kv_components_per_layer = tuple(per_layer)
            if len(per_layer) != self.num_layers:
                raise ValueError(
                    f"mea_num_kv_components_per_layer has {len(per_layer)} entries, "
                    f"num_layers is {self.num_layers}"
                )
            # Megatron stacks each tensor of all layers under one key, which needs one shape;
            # with per-layer shapes, checkpoint every layer under its own key instead.
            self.hetereogenous_dist_checkpoint = True
            mea_layers = [n for n in range(1, self.num_layers + 1) if self.variant_of(n) == "mea"]
            for nc in sorted({per_layer[n - 1] for n in mea_layers}, key=str):
                self._check_components("mea_num_kv_components_per_layer", nc)
        counts = {
            self.kv_components(n)
            for n in range(1, self.num_layers + 1)
            if self.variant_of(n) == "mea"
        } or {self.mea_num_kv_components}
        if not self.mea_hlc:
            if counts != {ng}:
                raise ValueError(
                    f"mea_hlc=False (head norm only) needs mea_num_kv_components "
                    f"({min(counts)}) == num_query_groups ({ng}): without HLC no composite heads "
                    "are built from fewer components"
                )
            if not self.mea_head_norm:
                raise ValueError(
                    "mea_hlc=False with mea_head_norm=False leaves nothing of MEA; use "
                    "attention_variant='standard'"
                )
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
        if self.mea_key_norm_before_mix and not self.qk_layernorm:
            raise ValueError("mea_key_norm_before_mix=True needs a k norm (qk_layernorm=True)")
        if self.mea_key_norm_before_mix and self.mea_tp_exchange == "weights":
            raise ValueError(
                "mea_key_norm_before_mix=True cannot be combined with mea_tp_exchange='weights': "
                "the k norm between the projection and the mix does not fold into the K rows"
            )

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
        if self.kha_variant not in KHA_VARIANTS:
            raise ValueError(f"kha_variant ({self.kha_variant!r}) must be one of {KHA_VARIANTS}")
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
        if self.kha_init not in KHA_INITS:
            raise ValueError(f"kha_init ({self.kha_init!r}) must be one of {KHA_INITS}")
        # Canonical order, so that parameter creation (and checkpoints) do not depend on it.
        self.kha_targets = tuple(x for x in KHA_TARGETS if x in targets)
        if self.kha_fold_linear and self.kha_variant != "linear":
            raise ValueError(
                f"kha_fold_linear=True needs kha_variant='linear' (got {self.kha_variant!r}): "
                "the KHA MLP is not linear and does not fold"
            )
