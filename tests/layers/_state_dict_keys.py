"""The checkpoint keys of small models of every attention variant, fingerprinted so that a change
to how the layers are composed can be checked against the keys today's checkpoints hold.

A case's listing has one line per `state_dict()` entry (key and shape, in order) and one per
`sharded_state_dict()` entry (module path, checkpoint key, global and local shape, offsets,
replica id). `tests/layers/data/state_dict_keys.json` holds, per megatron-core release series
and per case, the sha256 of that listing, recorded from main f9d1493, before the layers' pieces
became `Submodules` fields (issue 35); `tests/layers/test_state_dict_keys.py` compares the
models built today against it.

    python -m tests.layers._state_dict_keys        # record this release series
    python -m tests.layers._state_dict_keys CASE   # print CASE's listing (run it on both
                                                   # commits and diff, when the test fails)
"""

import hashlib
import json
import pathlib
import sys

import torch
from megatron.core.models.gpt import GPTModel

from megatron_mea import get_gpt_decoder_block_spec, get_gpt_layer_spec
from tests._models import SEQ, VOCAB, tiny_config

DATA = pathlib.Path(__file__).parent / "data" / "state_dict_keys.json"

# name -> (config fields for tiny_config, how the spec is built). "block": the plugin's block
# spec; "layer": one layer spec shared by every layer (Megatron-LM's dense path, `--spec`);
# "sdpa": the block spec with the SDPA core attention.
CASES = {
    "standard": (dict(variant="standard"), "block"),
    "mea": (dict(variant="mea"), "block"),
    "mea-virtual-heads": (dict(variant="mea", mea_num_kv_components=2), "block"),
    "mea-no-head-norm": (dict(variant="mea", mea_head_norm=False), "block"),
    "mea-head-norm-only": (dict(variant="mea", mea_hlc=False), "block"),
    "mea-sdpa": (dict(variant="mea", mea_num_kv_components=2), "sdpa"),
    "mea-layer-spec": (dict(variant="mea", moe=False), "layer"),
    "kha-linear": (dict(variant="kha", kha_variant="linear"), "block"),
    "kha-fold-linear": (dict(variant="kha", kha_variant="linear", kha_fold_linear=True), "block"),
    "kha-mlp": (dict(variant="kha", kha_variant="mlp"), "block"),
    "kha-mlp-qk": (dict(variant="kha", kha_variant="mlp", kha_targets=("q", "k")), "block"),
    "kha-gate": (dict(variant="kha", kha_variant="gate"), "block"),
    "per-layer-standard-mea": (
        dict(variant="mea", attention_variant_per_layer=("standard", "mea"),
             mea_num_kv_components=2),
        "block",
    ),
    "per-layer-kha-standard": (
        dict(variant="kha", attention_variant_per_layer=("kha", "standard")), "block"),
    "per-layer-mea-components": (
        dict(variant="mea", attention_variant_per_layer=("mea", "mea"),
             mea_num_kv_components_per_layer=(4, 2)),
        "block",
    ),
    "per-layer-layer-spec": (
        dict(variant="mea", attention_variant_per_layer=("mea", "standard"), moe=False),
        "layer",
    ),
}


def release_series() -> str:
    """`0.16`, `0.19`, ...: the installed megatron-core's major.minor."""
    from megatron.core.package_info import __version__

    return ".".join(__version__.split(".")[:2])


def build(name: str):
    """The GPTModel of case `name` (local backend, seeded)."""
    fields, spec_kind = CASES[name]
    fields = dict(fields)
    config = tiny_config(fields.pop("variant"), **fields)
    if spec_kind == "layer":
        spec = get_gpt_layer_spec(config, use_transformer_engine=False)
    else:
        core = "sdpa" if spec_kind == "sdpa" else "megatron"
        spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=False, core_attention=core)
    torch.manual_seed(1234)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )


def build_kha_mla():
    """The KHA-MLA model of `tests/distributed/_mla_workers.py` (megatron-core 0.19 only)."""
    from tests.distributed._mla_workers import build_mla_gpt, mla_config

    return build_mla_gpt(mla_config())


def _shape(value) -> str:
    return "x".join(map(str, value)) or "()"


def _sharded_line(path, sharded) -> str:
    kind = type(sharded).__name__
    line = f"{path} -> {kind} {sharded.key} {_shape(getattr(sharded, 'global_shape', ()))}"
    if kind == "ShardedTensor":
        line += (
            f" local={_shape(sharded.local_shape)} offset={_shape(sharded.global_offset)}"
            f" fragments={_shape(sharded.axis_fragmentations)}"
            f" prepend={sharded.prepend_axis_num}"
        )
    return f"{line} replica={sharded.replica_id}"


def _flatten(tree, prefix=""):
    if not isinstance(tree, dict):
        yield prefix, tree
        return
    for key, value in tree.items():
        yield from _flatten(value, f"{prefix}/{key}" if prefix else str(key))


def listing(model) -> list:
    """One line per `state_dict()` entry (key and shape) and per `sharded_state_dict()` entry
    (module path, checkpoint key, global and local shape, offsets, replica id), in the order the
    model yields them."""
    state = [
        f"{key} {_shape(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}"
        for key, value in model.state_dict().items()
    ]
    return state + [_sharded_line(p, s) for p, s in _flatten(model.sharded_state_dict())]


def fingerprint(lines: list) -> str:
    """sha256 of a listing (the recorded form: the full listings would be 300 kB)."""
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def case_names() -> list:
    """The cases of this release series (KHA on MLA needs megatron-core 0.19)."""
    return list(CASES) + ([] if release_series() == "0.16" else ["kha-mla"])


def build_case(name: str):
    """The model of case `name`."""
    return build_kha_mla() if name == "kha-mla" else build(name)


def record(show=None) -> None:
    """Add this release series' fingerprints to `DATA`; with `show`, print that case's listing
    instead (one process, CPU)."""
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_mea.cpu import megatron_on_cpu
    from tests._dist import free_port
    from tests._models import init_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    with megatron_on_cpu():
        init_parallel(tp=1, ep=1)
        listings = {name: listing(build_case(name)) for name in ([show] if show else case_names())}
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    if show:
        print("\n".join(listings[show]))
        return
    data = json.loads(DATA.read_text()) if DATA.exists() else {}
    data[release_series()] = {name: fingerprint(lines) for name, lines in listings.items()}
    DATA.parent.mkdir(exist_ok=True)
    DATA.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    record(show=sys.argv[1] if len(sys.argv) > 1 else None)
