"""Import pads a vocabulary that TP cannot split (1001 tokens) to a multiple of 128, records the
multiple and the true size so `mea-pretrain` accepts the checkpoint at TP 1/2/4/8, and export
strips the padding rows again; a multiple TP cannot split is refused in one line."""

import dataclasses
import os

import pytest
import torch
import yaml
from safetensors.torch import load_file

from megatron_mea.apps.training.arguments import PretrainArgs, validate
from megatron_mea.checkpoint.hf.exporting import export_hf_checkpoint
from megatron_mea.checkpoint.torch_dist.layerwise import read_checkpoint
from megatron_mea.cli.convert import main
from tests.checkpoint._hf_models import (
    assert_same_hf_checkpoint,
    build_hf_model,
    save_hf_model,
)

VOCAB = 1001  # odd: no TP size > 1 divides it


@pytest.fixture(scope="module")
def odd_vocab(tmp_path_factory, single_rank):
    """(HF directory, Megatron import at TP=2) of a tiny Llama with 1001 tokens."""
    root = tmp_path_factory.mktemp("odd_vocab")
    hf_dir = save_hf_model(build_hf_model("llama", vocab_size=VOCAB), str(root / "hf"))
    meg = str(root / "meg")
    assert main(["--quiet", "import-hf", "--hf-dir", hf_dir, "--save", meg,
                 "--tensor-model-parallel-size", "2"]) == 0
    return hf_dir, meg


def test_import_pads_to_128_rows_and_every_tp_size_accepts_it(odd_vocab):
    hf_dir, meg = odd_vocab
    with open(os.path.join(meg, "config.yaml")) as handle:
        saved = yaml.safe_load(handle)
    assert (saved["vocab_size"], saved["make_vocab_size_divisible_by"]) == (VOCAB, 128)
    args = PretrainArgs(**saved)
    assert args.padded_vocab_size == 1024
    hf = load_file(os.path.join(hf_dir, "model.safetensors"))
    tensors = dict(read_checkpoint(meg)[1])[-1]
    for name, hf_name in (("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
                          ("output_layer.weight", "lm_head.weight")):
        assert tensors[name].shape == (1024, 64)
        assert torch.equal(tensors[name][:VOCAB], hf[hf_name])
        assert not tensors[name][VOCAB:].any()  # zero rows: logits 0, never a real token
    for tp in (1, 2, 4, 8):  # what `mea-pretrain --config <meg>/config.yaml --load <meg>` checks
        validate(dataclasses.replace(args, tensor_model_parallel_size=tp, mock_data=True,
                                     load=meg), world_size=tp)


def test_export_strips_the_padding(odd_vocab, tmp_path):
    hf_dir, meg = odd_vocab
    out = str(tmp_path / "hf")
    export_hf_checkpoint(meg, out)
    assert_same_hf_checkpoint(hf_dir, out)


def test_a_multiple_tp_cannot_split_is_refused_in_one_line(odd_vocab, tmp_path, capsys):
    save = str(tmp_path / "meg")
    assert main(["--quiet", "import-hf", "--hf-dir", odd_vocab[0], "--save", save,
                 "--tensor-model-parallel-size", "8", "--make-vocab-size-divisible-by", "100"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "mea-convert: error: make_vocab_size_divisible_by (100) must be a positive multiple of "
        "tensor_model_parallel_size (8)"
    ], err
    assert not os.path.exists(save)
