"""Hugging Face <-> Megatron: bit-exact round trips, and the imported Megatron model computes the
HF model's logits at TP=1, TP=2 (with EP for MoE) and loads at PP=2."""

import os

import pytest
import torch
from safetensors.torch import load_file

from megatron_mea.checkpoint.hf.exporting import export_hf_checkpoint
from megatron_mea.checkpoint.torch_dist.layerwise import read_checkpoint
from tests._dist import run_distributed
from tests.checkpoint._hf_models import (
    FAMILIES,
    assert_same_hf_checkpoint,
    hf_logits,
    tokens,
)
from tests.checkpoint._megatron import megatron_logits

ATOL = 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_to_megatron_to_hf_round_trip_is_bit_exact(checkpoints, tmp_path, family):
    hf_dir, _ = checkpoints.hf(family)
    out = str(tmp_path / "hf")
    assert export_hf_checkpoint(checkpoints.imported(family), out) == "plain"
    assert_same_hf_checkpoint(hf_dir, out)


def test_export_dtype_names_the_written_tensors(checkpoints, tmp_path):
    """config.json's dtype is written before the tensors: it must still be theirs, saved or
    asked for."""
    import json

    for asked in (None, torch.bfloat16):
        out = str(tmp_path / str(asked))
        export_hf_checkpoint(checkpoints.imported("qwen3"), out, dtype=asked)
        with open(os.path.join(out, "config.json")) as handle:
            named = json.load(handle)["dtype"]
        written = {str(t.dtype) for t in load_file(os.path.join(out, "model.safetensors")).values()}
        assert written == {f"torch.{named}"}
        assert asked is None or named == "bfloat16"


def test_stock_transformers_loads_the_export_with_the_same_logits(checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    _, model = checkpoints.hf("qwen3_moe")
    out = str(tmp_path / "hf")
    export_hf_checkpoint(checkpoints.imported("qwen3_moe"), out)
    reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    torch.testing.assert_close(hf_logits(reloaded, tokens()), hf_logits(model, tokens()))


def test_checkpoint_holds_the_megatron_layouts(checkpoints):
    _, model = checkpoints.hf("qwen2")
    _, groups = read_checkpoint(checkpoints.imported("qwen2"))
    layer0 = dict(groups)[0]
    hf = model.state_dict()
    qkv = layer0["decoder.layers.0.self_attention.linear_qkv.weight"].view(4, 4, 8, 64)
    # Group 1 of 4: query heads 2 and 3, then key head 1, then value head 1.
    assert torch.equal(qkv[1, 0], hf["model.layers.0.self_attn.q_proj.weight"].view(8, 8, 64)[2])
    assert torch.equal(qkv[1, 2], hf["model.layers.0.self_attn.k_proj.weight"].view(4, 8, 64)[1])
    assert torch.equal(qkv[1, 3], hf["model.layers.0.self_attn.v_proj.weight"].view(4, 8, 64)[1])
    fc1 = layer0["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1[:96], hf["model.layers.0.mlp.gate_proj.weight"])  # gate first
    assert torch.equal(fc1[96:], hf["model.layers.0.mlp.up_proj.weight"])
    assert "decoder.layers.0.self_attention.linear_qkv.bias" in layer0


CASES = [(family, "standard", {}) for family in FAMILIES] + [
    ("qwen3", "mea", {}),
    ("qwen3", "kha", {}),
    ("qwen3", "kha", {"kha_variant": "mlp"}),
    ("qwen3_moe", "mea", {}),
    ("qwen2", "kha", {}),
]


@pytest.mark.parametrize("family,variant,options", CASES,
                         ids=[f"{f}-{v}{'-mlp' if o else ''}" for f, v, o in CASES])
def test_imported_megatron_model_computes_the_hf_logits(checkpoints, family, variant, options):
    _, model = checkpoints.hf(family)
    ids = tokens()
    expected = hf_logits(model, ids)
    got = megatron_logits(checkpoints.imported(family, variant, **options), ids)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=1e-4)


def test_upcycled_mea_with_head_norm_differs_from_the_baseline(checkpoints):
    # Guard: the head norm (scale 1) is not an identity, so the comparison above is not vacuous.
    _, model = checkpoints.hf("qwen3")
    ids = tokens()
    got = megatron_logits(checkpoints.imported("qwen3", "mea", mea_head_norm=True), ids)
    assert (got - hf_logits(model, ids)).abs().max() > 1e-2


def _tp2_logits_and_pp2_parameters(rank, world_size, cases, pp_root):
    from megatron.core import parallel_state

    from megatron_mea.checkpoint.torch_dist.model_only import (
        ModelDescription,
        build_stage_model,
        load_model_weights,
    )
    from tests._models import expert_tp_size, init_parallel

    logits = []
    for root, ep in cases:
        init_parallel(tp=2, ep=ep)
        parallel = dict(tensor_model_parallel_size=2, expert_model_parallel_size=ep,
                        expert_tensor_parallel_size=expert_tp_size(2, ep))
        logits.append(megatron_logits(root, tokens(), **parallel))

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    model = build_stage_model(ModelDescription.load(pp_root), pipeline_model_parallel_size=2)
    load_model_weights(model, pp_root)
    # One layer per stage: local layer 0 is global layer `rank`.
    params = {
        name.replace("layers.0.", f"layers.{rank}."): param.detach()
        for name, param in model.named_parameters()
    }
    return logits, params


@pytest.mark.slow
def test_logits_at_tp2_and_ep2_and_parameters_at_pp2_match(checkpoints):
    cases = [
        ("qwen2", "standard", {}, 1),
        ("qwen3", "mea", {}, 1),
        ("qwen3_moe", "kha", {"kha_variant": "mlp"}, 2),
        ("mixtral", "standard", {}, 1),
    ]
    roots = [(checkpoints.imported(f, v, **o), ep) for f, v, o, ep in cases]
    pp_root = checkpoints.imported("qwen3_moe", "kha", kha_variant="mlp")
    (logits0, stage0), (logits1, stage1) = run_distributed(
        _tp2_logits_and_pp2_parameters, 2, roots, pp_root
    )
    for (family, *_), rank0, rank1 in zip(cases, logits0, logits1, strict=True):
        expected = hf_logits(checkpoints.hf(family)[1], tokens())
        torch.testing.assert_close(rank0, expected, atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(rank1, expected, atol=ATOL, rtol=1e-4)

    _, groups = read_checkpoint(pp_root)
    full = {name: t for _, tensors in groups for name, t in tensors.items()}
    assert "embedding.word_embeddings.weight" in stage0 and "output_layer.weight" in stage1
    for stage in (stage0, stage1):
        for name, tensor in stage.items():
            assert torch.equal(tensor, full[name]), name
    assert set(stage0) | set(stage1) == set(full)


def test_tied_embeddings_round_trip_and_compute_the_hf_logits(tmp_path, single_rank):
    from megatron_mea.checkpoint.hf.importing import import_hf_checkpoint
    from tests.checkpoint._hf_models import build_hf_model, save_hf_model

    model = build_hf_model("qwen3", tie_word_embeddings=True)
    hf_dir = save_hf_model(model, str(tmp_path / "hf"))
    assert "lm_head.weight" not in load_file(os.path.join(hf_dir, "model.safetensors"))
    meg = str(tmp_path / "meg")
    description = import_hf_checkpoint(hf_dir, meg)
    assert not description.args.untie_embeddings_and_output_weights
    torch.testing.assert_close(megatron_logits(meg, tokens()), hf_logits(model, tokens()),
                               atol=ATOL, rtol=1e-4)
    out = str(tmp_path / "out")
    export_hf_checkpoint(meg, out)
    assert_same_hf_checkpoint(hf_dir, out, config=False)


def test_padded_vocabulary_round_trips_and_keeps_the_logits(checkpoints, tmp_path):
    from megatron_mea.checkpoint.hf.importing import import_hf_checkpoint

    hf_dir, model = checkpoints.hf("llama")
    meg = str(tmp_path / "meg")
    import_hf_checkpoint(hf_dir, meg, make_vocab_size_divisible_by=128)
    embedding = dict(read_checkpoint(meg)[1])[-1]["embedding.word_embeddings.weight"]
    assert embedding.shape == (128, 64) and not embedding[96:].any()
    torch.testing.assert_close(megatron_logits(meg, tokens()), hf_logits(model, tokens()),
                               atol=ATOL, rtol=1e-4)
    out = str(tmp_path / "out")
    export_hf_checkpoint(meg, out)
    assert_same_hf_checkpoint(hf_dir, out, config=False)


@pytest.mark.parametrize("family,options", [
    ("qwen3", {}), ("mixtral", {}), ("qwen3_moe", {}),
    ("qwen3_moe", {"mea_head_norm": True}),  # MEA with the head norm: the native format
], ids=["qwen3", "mixtral", "qwen3_moe", "qwen3_moe-native"])
def test_training_settings_survive_export_and_import(checkpoints, tmp_path, family, options):
    """Every training setting an HF config has a field for (the carried fields of scope
    "init" or "training") comes back from a real export then import: continued pretraining
    trains as the run did (the MoE aux-loss coefficient came back as transformers' default
    0.001, ten times smaller than 0.01)."""
    import shutil

    import yaml

    from megatron_mea.checkpoint.hf.fields import CARRIED, of_family
    from megatron_mea.checkpoint.hf.importing import import_hf_checkpoint
    from megatron_mea.model.args import MODEL_FIELDS, declared

    run = str(tmp_path / "run")
    variant = "mea" if options else "standard"
    shutil.copytree(checkpoints.imported(family, variant, **options), run)
    training = [name for carried in of_family(CARRIED, family) for name in carried.run
                if name in MODEL_FIELDS
                and declared(name).metadata["scope"] in ("init", "training")]
    assert "init_method_std" in training and ("moe_aux_loss_coeff" in training) == (
        family != "qwen3")
    # Values no default has, one per field.
    wanted = {name: 0.0125 * (index + 1) for index, name in enumerate(training)}
    config_path = os.path.join(run, "config.yaml")
    with open(config_path) as handle:
        saved = yaml.safe_load(handle)
    saved.update(wanted)
    with open(config_path, "w") as handle:
        yaml.safe_dump(saved, handle)
    exported, again = str(tmp_path / "hf"), str(tmp_path / "again")
    fmt = export_hf_checkpoint(run, exported)
    assert fmt == ("native" if options else "plain")
    back = import_hf_checkpoint(exported, again).args
    assert {name: getattr(back, name) for name in wanted} == wanted
