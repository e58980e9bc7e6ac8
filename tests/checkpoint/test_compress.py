"""MEA post-hoc KV compression: SVD over K/V heads, layer selection, the per-layer probe, and a
compressed checkpoint that the pretraining driver continues from."""

import os

import pytest
import torch
from megatron.core.inference.contexts import StaticInferenceContext

from megatron_mea.checkpoint.hf.exporting import export_hf_checkpoint
from megatron_mea.checkpoint.hf.importing import import_hf_checkpoint
from megatron_mea.checkpoint.errors import ConversionError
from megatron_mea.checkpoint.torch_dist.layerwise import read_checkpoint
from megatron_mea.checkpoint.transforms.compress import (
    approximate_layer,
    compress_checkpoint,
    probe_layers,
    select_layers,
    svd_heads,
)
from megatron_mea.data.samples import load_tokens
from tests.checkpoint._hf_models import (
    VOCAB,
    build_hf_model,
    hf_logits,
    save_hf_model,
    tokens,
)
from tests.checkpoint._megatron import megatron_logits, rewrite_checkpoint


@pytest.mark.parametrize(
    "selection,expected",
    [("all", list(range(8))), ("middle-half", [2, 3, 4, 5]), ("all-but-first-3", [3, 4, 5, 6, 7]),
     ("0,3,5-7", [0, 3, 5, 6, 7]), (" 1 ", [1])],
)
def test_layer_selection(selection, expected):
    assert select_layers(selection, 8) == expected


def test_paper_half_is_the_mea_papers_window():
    # The MEA paper's half setting on its 48-layer model: Hugging Face layers 11-34 (0-based).
    assert select_layers("paper-half", 48) == list(range(11, 35))
    assert select_layers("paper-half", 8) == [1, 2, 3, 4]


@pytest.mark.parametrize("selection", ["half", "8", "2-x", "1,,2"])
def test_bad_layer_selection_is_refused(selection):
    with pytest.raises(ValueError, match="layer"):
        select_layers(selection, 8)


def test_svd_is_exact_at_full_rank_and_frobenius_optimal_below():
    heads = torch.randn(4, 8, 16)
    components, mix = svd_heads(heads, 4)
    torch.testing.assert_close(torch.einsum("jdh,jg->gdh", components, mix), heads,
                               atol=1e-5, rtol=1e-5)
    components, mix = svd_heads(heads, 2)
    error = torch.linalg.norm(torch.einsum("jdh,jg->gdh", components, mix) - heads)
    singular = torch.linalg.svdvals(heads.reshape(4, -1).double())
    torch.testing.assert_close(error.double(), singular[2:].norm(), rtol=1e-4, atol=1e-6)


def _cache_shapes(root, ids):
    context = StaticInferenceContext(ids.shape[0], 32)
    megatron_logits(root, ids, inference_context=context)
    return {layer: tuple(key.shape) for layer, (key, _) in context.key_value_memory_dict.items()}


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_nc_equal_ng_is_exact_and_nc_half_halves_kv_rows_and_cache(checkpoints, tmp_path, family):
    source = checkpoints.imported(family)
    exact = compress_checkpoint(source, str(tmp_path / "nc4"), 4)
    assert exact.args.attention_variant == "mea" and not exact.args.mea_head_norm
    ids = tokens()
    baseline = megatron_logits(source, ids)
    torch.testing.assert_close(megatron_logits(str(tmp_path / "nc4"), ids), baseline,
                               atol=1e-4, rtol=1e-4)

    half = str(tmp_path / "nc2")
    compress_checkpoint(source, half, 2)
    _, before = read_checkpoint(source)
    _, after = read_checkpoint(half)
    before, after = dict(before)[0], dict(after)[0]
    rows = lambda t: t["decoder.layers.0.self_attention.linear_qkv.weight"].shape[0]  # noqa: E731
    assert rows(before) == (8 + 2 * 4) * 8 and rows(after) == (8 + 2 * 2) * 8
    assert after["decoder.layers.0.self_attention.head_mix.key_weight"].shape == (2, 4)
    # The static KV cache holds [max_seq, batch, K/V heads, hn] per layer.
    assert all(shape[2] == 4 for shape in _cache_shapes(source, ids).values())
    assert all(shape[2] == 2 for shape in _cache_shapes(half, ids).values())
    assert (megatron_logits(half, ids) - baseline).abs().max() > 1e-3  # a real approximation


def test_probe_approximation_is_the_compressed_model(checkpoints, tmp_path):
    # Compressing every layer in place (the probe's edit) computes what the checkpoint does.
    source = checkpoints.imported("qwen3")
    compressed = str(tmp_path / "nc2")
    compress_checkpoint(source, compressed, 2)
    description, _ = read_checkpoint(source)
    config = description.config
    edited = rewrite_checkpoint(
        source, str(tmp_path / "approx"),
        lambda layer, t: t if layer < 0 else approximate_layer(t, layer, config, 2),
    )
    ids = tokens()
    torch.testing.assert_close(megatron_logits(edited, ids), megatron_logits(compressed, ids),
                               atol=1e-4, rtol=1e-4)


def test_compressed_mea_keeps_its_head_norm_and_exports_natively(checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    import megatron_mea.integrations.transformers  # noqa: F401

    source = checkpoints.imported("qwen3", "mea", mea_head_norm=True)
    out = str(tmp_path / "nc2")
    assert compress_checkpoint(source, out, 2).args.mea_head_norm
    hf_dir = str(tmp_path / "hf")
    assert export_hf_checkpoint(out, hf_dir) == "native"
    model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (2 * 8, 64)
    ids = tokens()
    expected = megatron_logits(out, ids)
    torch.testing.assert_close(hf_logits(model, ids), expected, atol=1e-4, rtol=1e-4)
    # The native export (2 component heads) imports back as the same MEA model.
    again = str(tmp_path / "again")
    assert import_hf_checkpoint(hf_dir, again).args.mea_num_kv_components == 2
    torch.testing.assert_close(megatron_logits(again, ids), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_norm_then_mix_is_another_function_exported_with_a_component_cache(checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    import megatron_mea.integrations.transformers  # noqa: F401
    from megatron_mea.cli.convert import main

    source = checkpoints.imported("qwen3")
    before, after = str(tmp_path / "norm-then-mix"), str(tmp_path / "mix-then-norm")
    assert main(["--quiet", "compress", "--load", source, "--save", before,
                 "--num-kv-components", "2", "--mea-key-norm-before-mix"]) == 0
    assert not compress_checkpoint(source, after, 2).args.mea_key_norm_before_mix
    ids = tokens()
    expected = megatron_logits(before, ids)
    # The same weights (the SVD), a different function.
    assert (expected - megatron_logits(after, ids)).abs().max() > 1e-3
    hf_dir = str(tmp_path / "hf")
    assert export_hf_checkpoint(before, hf_dir) == "native"
    model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    assert model.config.mea_key_norm_before_mix
    torch.testing.assert_close(hf_logits(model, ids), expected, atol=1e-4, rtol=1e-4)
    # Generation with the cache: the components alone (no key scales), the same greedy tokens
    # as recomputing the whole sequence each step.
    prompt = ids[:1, :6]
    out = model.generate(prompt, max_new_tokens=5, do_sample=False, use_cache=True)
    step = prompt
    for _ in range(5):
        step = torch.cat([step, hf_logits(model, step)[:, -1].argmax(-1, keepdim=True)], 1)
    assert out.tolist() == step.tolist()
    attention = model.model.layers[0].self_attn
    assert attention.caches_components and attention.key_norm_before_mix


def test_compressing_a_subset_of_layers_keeps_the_others_exact(checkpoints, tmp_path):
    source = checkpoints.imported("qwen3")
    out = str(tmp_path / "last-only")
    target = compress_checkpoint(source, out, 2, layers="all-but-first-1")
    assert target.args.mea_num_kv_components_per_layer == [4, 2]
    # As in the paper, the uncompressed layer of a baseline stays standard attention.
    assert list(target.args.attention_variant_per_layer) == ["standard", "mea"]
    _, groups = read_checkpoint(out)
    layers = dict(groups)
    assert not any(".self_attention.head_" in name for name in layers[0])
    assert "decoder.layers.1.self_attention.head_mix.key_weight" in layers[1]
    rows = lambda t, i: t[f"decoder.layers.{i}.self_attention.linear_qkv.weight"].shape[0]  # noqa: E731
    assert rows(layers[0], 0) == (8 + 2 * 4) * 8 and rows(layers[1], 1) == (8 + 2 * 2) * 8
    ids = tokens()
    assert sorted(shape[2] for shape in _cache_shapes(out, ids).values()) == [2, 4]
    # Layer 0 is an exact reparametrisation: the model equals the source with only layer 1
    # approximated (the probe's in-place edit).
    description, _ = read_checkpoint(source)
    config = description.config
    edited = rewrite_checkpoint(
        source, str(tmp_path / "approx"),
        lambda layer, t: approximate_layer(t, layer, config, 2) if layer == 1 else t,
    )
    torch.testing.assert_close(megatron_logits(out, ids), megatron_logits(edited, ids),
                               atol=1e-4, rtol=1e-4)
    with pytest.raises(ConversionError, match="mea_num_kv_components_per_layer: a native export"):
        export_hf_checkpoint(out, str(tmp_path / "hf"), format="native")
    # Without the head norm every layer folds back into a stock model, whatever its nc.
    from transformers import AutoModelForCausalLM

    assert export_hf_checkpoint(out, str(tmp_path / "plain"), format="plain") == "plain"
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "plain"),
                                                 attn_implementation="eager").eval()
    torch.testing.assert_close(hf_logits(model, ids), megatron_logits(out, ids),
                               atol=1e-4, rtol=1e-4)
    with pytest.raises(ConversionError, match="between 1 and"):
        compress_checkpoint(source, str(tmp_path / "y"), 5)


def test_cli_reports_the_counts_written_and_compression_never_adds_components(
        checkpoints, tmp_path, capsys):
    from megatron_mea.cli.convert import main

    source = checkpoints.imported("qwen3")  # 2 layers, 4 K/V heads
    subset = str(tmp_path / "subset")
    assert main(["--quiet", "compress", "--load", source, "--save", subset,
                 "--num-kv-components", "2", "--layers", "all-but-first-1"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"mea-convert compress: read iteration 0 from {source}",
        f"wrote {subset} (MEA; K/V heads per layer, cached: [4, 2])"]
    # "Compressing" to more components than a layer has is refused: one line, nothing written.
    grown = str(tmp_path / "grown")
    assert main(["--quiet", "compress", "--load", subset, "--save", grown,
                 "--num-kv-components", "4"]) == 2
    assert capsys.readouterr().err.strip() == (
        "mea-convert: error: num_kv_components (4) exceeds the 2 K/V components layer 1 has: "
        "compression cannot add components")
    assert not os.path.exists(grown)
    # A layer left out keeps its count (2), not the query groups (4).
    again = compress_checkpoint(subset, str(tmp_path / "again"), 1, layers="0")
    assert again.args.mea_num_kv_components_per_layer == [1, 2]
    ids = tokens()
    assert sorted(shape[2] for shape in _cache_shapes(str(tmp_path / "again"), ids).values()) == [
        1, 2]


@pytest.fixture(scope="module")
def low_rank_first_layer(tmp_path_factory, single_rank):
    """A Llama whose layer 0 K/V already have rank 2 over heads (compressing it to 2 costs
    nothing) while layer 1 K/V are full rank, with sharp attention so compression matters."""
    model = build_hf_model("llama", seed=11, rms_norm_eps=1e-5)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.weight.normal_(0, 0.4, generator=gen)
        for name in ("k_proj", "v_proj"):
            weight = getattr(model.model.layers[0].self_attn, name).weight.view(4, 8, 64)
            weight[2:] = 0.7 * weight[:2] - 0.3 * weight[[1, 0]]
    root = tmp_path_factory.mktemp("lowrank")
    save_hf_model(model, str(root / "meg_hf"))
    import_hf_checkpoint(str(root / "meg_hf"), str(root / "meg"))
    return str(root / "meg")


def _token_dataset(prefix, num_documents=8, length=40):
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.int32)
    gen = torch.Generator().manual_seed(1)
    for _ in range(num_documents):
        builder.add_document(torch.randint(0, VOCAB, (length,), generator=gen), [length])
    builder.finalize(prefix + ".idx")
    return prefix


def test_probe_ranks_the_low_rank_layer_first(low_rank_first_layer, tmp_path, capsys):
    prefix = _token_dataset(str(tmp_path / "tokens"))
    data = load_tokens(prefix, seq_length=12, num_samples=6)
    assert data.shape == (6, 13) and int(data.max()) < VOCAB
    result = probe_layers(low_rank_first_layer, data, 2)
    (first, cost0), (second, cost1) = result.ranking()
    assert (first, second) == (0, 1)
    assert abs(cost0) < 1e-4 < cost1

    from megatron_mea.cli.convert import main

    assert main(["--quiet", "probe", "--load", low_rank_first_layer, "--num-kv-components", "2",
                 "--data-path", prefix, "--seq-length", "12", "--num-samples", "6"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[-1] == f"mea-convert probe: read iteration 0 from {low_rank_first_layer}"
    assert table[0].startswith("baseline loss")
    assert table[2].split()[:2] == ["1", "0"] and table[3].split()[:2] == ["2", "1"]


def test_pretraining_driver_continues_from_the_compressed_checkpoint(low_rank_first_layer,
                                                                    tmp_path, caplog):
    compressed = str(tmp_path / "nc2")
    compress_checkpoint(low_rank_first_layer, compressed, 2)
    prefix = _token_dataset(str(tmp_path / "tokens"), num_documents=64)
    argv = [
        "--config", os.path.join(compressed, "config.yaml"), "--load", compressed,
        "--save", str(tmp_path / "run"), "--data-path", prefix, "--split", "90,10,0",
        "--seq-length", "12", "--micro-batch-size", "2", "--global-batch-size", "2",
        "--train-iters", "2", "--eval-interval", "1000", "--eval-iters", "1",
        "--log-interval", "1000", "--no-progress-bar", "--lr", "1e-4", "--min-lr", "1e-5",
        "--data-cache-path", str(tmp_path / "cache"),
    ]
    from megatron.core import parallel_state

    from megatron_mea.apps.training.arguments import parse_run
    from megatron_mea.apps.training.loop import pretrain
    from tests._models import init_parallel

    # In this process (a world of one is up): the driver sets up Megatron's parallel state and
    # tears it down at the end; the session's other tests get theirs back afterwards.
    parallel_state.destroy_model_parallel()
    try:
        losses = [record["lm loss"] for record in pretrain(*parse_run(argv))]
    finally:
        init_parallel()
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert any("loading the model only" in r.getMessage() for r in caplog.records)
    assert os.path.isdir(tmp_path / "run" / "iter_0000002")

    # The run's directory has no conversion.json: export infers the family (or takes a
    # reference config) and folds the MEA mixing; the stock model computes the run's model.
    from transformers import AutoModelForCausalLM

    run = str(tmp_path / "run")
    for name, reference in (("inferred", None), ("referenced", low_rank_first_layer + "_hf")):
        out = str(tmp_path / name)
        assert export_hf_checkpoint(run, out, reference=reference) == "plain"
        model = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
        assert type(model).__name__ == "LlamaForCausalLM"
        torch.testing.assert_close(hf_logits(model, tokens()), megatron_logits(run, tokens()),
                                   atol=1e-4, rtol=1e-4)
