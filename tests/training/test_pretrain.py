"""`mea-pretrain` end to end on CPU: parallel runs learn, and resuming is exact."""

import json
import math
import os

import pytest

from tests._dist import run_distributed
from tests._models import tiny_flags

pytestmark = pytest.mark.slow

SMALL = tiny_flags(seq_length=64, lr=3e-3, min_lr=3e-4, split="90,10,0")


@pytest.fixture(scope="module")
def text_dataset(tmp_path_factory):
    """A small real-text dataset: a slice of the stdlib corpus, byte-level tokens."""
    from megatron_mea.data import build_stdlib_corpus, build_tokenizer, preprocess_files

    root = tmp_path_factory.mktemp("data")
    corpus = str(root / "corpus.jsonl")
    build_stdlib_corpus(corpus, max_bytes=400_000)
    prefix = str(root / "corpus_text_document")
    summary = preprocess_files(
        [corpus], prefix, build_tokenizer("ByteLevelTokenizer"), append_eod=True, progress=False
    )
    assert summary.written and summary.tokens > 300_000
    return prefix


def _train(rank, world_size, argv):
    from megatron_mea.apps.training.arguments import parse_run
    from megatron_mea.apps.training.loop import pretrain

    return [record["lm loss"] for record in pretrain(*parse_run(argv))]


def _train_counting_folds(rank, world_size, argv):
    """`_train`, and how many times the layers' step caches built, reused and flushed a fold."""
    from megatron_mea.layers.fold_cache import FoldCache

    counts = dict(built=0, reused=0, flushed=0)
    get, flush = FoldCache.get, FoldCache.flush

    def counting_get(cache, build, params):
        counts["reused" if cache.live else "built"] += 1
        return get(cache, build, params)

    def counting_flush(cache):
        counts["flushed"] += cache.live
        return flush(cache)

    FoldCache.get, FoldCache.flush = counting_get, counting_flush
    return _train(rank, world_size, argv), counts


def _mean(values):
    return sum(values) / len(values)


@pytest.mark.parametrize(
    "parallel",
    [
        ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--attention-variant", "mea"],
        ["--expert-model-parallel-size", "2", "--attention-variant", "kha"],
    ],
    ids=["tp2-sp-mea", "ep2-kha"],
)
def test_two_process_run_lowers_the_loss(text_dataset, tmp_path, parallel):
    argv = [*SMALL, "--data-path", text_dataset, "--train-iters", "40",
            "--data-cache-path", str(tmp_path / "cache"), *parallel]
    losses = run_distributed(_train, 2, argv)
    assert losses[0] == losses[1]  # every rank reports the same (reduced) loss
    first, last = _mean(losses[0][:5]), _mean(losses[0][-5:])
    assert last < first - 1.0, (first, last)


def test_interrupted_and_resumed_run_reproduces_the_loss_sequence_exactly(text_dataset, tmp_path):
    common = [*SMALL, "--data-path", text_dataset, "--train-iters", "12",
              "--attention-variant", "mea", "--data-cache-path", str(tmp_path / "cache")]
    full = run_distributed(_train, 1, [*common, "--save", str(tmp_path / "full"),
                                       "--tensorboard-dir", str(tmp_path / "tb")])[0]
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "tb"))
    assert (tmp_path / "full" / "config.yaml").exists()
    interrupted = str(tmp_path / "interrupted")
    first = run_distributed(_train, 1, [*common, "--save", interrupted, "--exit-interval", "5"])[0]
    second = run_distributed(_train, 1, [*common, "--save", interrupted, "--load", interrupted])[0]
    assert len(first) == 5 and len(second) == 7
    assert first + second == full  # bitwise: same floats
    with open(os.path.join(interrupted, "metrics.jsonl"), encoding="utf-8") as handle:
        assert [json.loads(line)["iteration"] for line in handle] == list(range(1, 13))


@pytest.mark.parametrize(
    "variant,folded",
    [
        (["--attention-variant", "mea", "--mea-num-kv-components", "2"],
         ["--mea-tp-exchange", "weights"]),
        (["--attention-variant", "kha", "--kha-variant", "linear"], ["--kha-fold-linear"]),
    ],
    ids=["mea-weights", "kha-fold-linear"],
)
def test_folded_projection_with_its_step_cache_trains_like_the_unfolded_model(
    text_dataset, tmp_path, variant, folded
):
    # TP=2 + SP, two micro-batches per step: the trainer folds once per step and flushes the
    # fold's gradient in finalize_model_grads, through DDP and Megatron's optimizer.
    common = [*SMALL, "--data-path", text_dataset, "--train-iters", "6", *variant,
              "--tensor-model-parallel-size", "2", "--sequence-parallel",
              "--data-cache-path", str(tmp_path / "cache")]
    plain, plain_folds = run_distributed(_train_counting_folds, 2, common)[0]
    fold, folds = run_distributed(_train_counting_folds, 2, [*common, *folded])[0]
    assert len(plain) == len(fold) == 6
    assert max(abs(a - b) for a, b in zip(plain, fold)) < 1e-4, (plain, fold)
    assert plain[-1] < plain[0]  # the steps really trained
    # The folded run took the fold path: each of the 2 layers folded once per step (6 steps),
    # its second micro-batch reused the fold, and every fold's gradient was flushed; the plain
    # run never folded.
    assert folds == dict(built=12, reused=12, flushed=12), folds
    assert plain_folds == dict(built=0, reused=0, flushed=0), plain_folds


def test_tensor_parallel_run_matches_the_single_process_run(tmp_path):
    # Dense standard attention on mock data: TP=2+SP (and plain DP=2) must train like one
    # process. Each rank must see whole sequences at CP=1 (Megatron-Core 0.17+ sliced them over
    # the world when the CP group was not passed).
    common = tiny_flags(num_query_groups=None, seq_length=64, num_experts=0,
                        moe_ffn_hidden_size=None, micro_batch_size=2, global_batch_size=4,
                        train_iters=3, mock_data=True, attention_variant="standard",
                        data_cache_path=str(tmp_path / "cache"))
    single = run_distributed(_train, 1, common)[0]
    tp_sp = run_distributed(
        _train, 2, [*common, "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    )[0]
    dp = run_distributed(_train, 2, common)[0]
    assert len(single) == len(tp_sp) == len(dp) == 3
    assert max(abs(a - b) for a, b in zip(single, tp_sp)) < 1e-5, (single, tp_sp)
    assert max(abs(a - b) for a, b in zip(single, dp)) < 1e-5, (single, dp)


def _histories(rank, world_size, argvs):
    from megatron_mea.apps.training.arguments import parse_run
    from megatron_mea.apps.training.loop import pretrain

    return [pretrain(*parse_run(argv)) for argv in argvs]


def test_eval_iters_zero_means_no_evaluation(tmp_path):
    # Evaluation is due after every step; --eval-iters 0 turns it off (it used to divide by zero
    # after training). The same run with --eval-iters 1, in the same process, does evaluate.
    argv = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
            "--seq-length", "32", "--num-experts", "0", "--micro-batch-size", "2",
            "--global-batch-size", "2", "--train-iters", "2", "--eval-interval", "1",
            "--log-interval", "1", "--no-progress-bar", "--mock-data",
            "--data-cache-path", str(tmp_path / "cache")]
    off, on = run_distributed(_histories, 1, [
        [*argv, "--eval-iters", "0", "--save", str(tmp_path / "ckpt")],
        [*argv, "--eval-iters", "1"],
    ])[0]
    assert [record["iteration"] for record in off] == [1, 2]
    assert not any("valid loss" in record for record in off)
    with open(tmp_path / "ckpt" / "metrics.jsonl", encoding="utf-8") as handle:
        assert [json.loads(line)["iteration"] for line in handle] == [1, 2]
    assert [record["iteration"] for record in on] == [1, 2]
    assert all(math.isfinite(record["valid loss"]) for record in on)
