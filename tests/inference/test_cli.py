"""`mea-generate` on a checkpoint written by `mea-pretrain`: greedy decoding is deterministic,
streamed or not, identical at TP=1 and TP=2, and the report gives tokens/s and KV-cache bytes."""

import re

import pytest

from tests._dist import run_distributed
from tests._models import tiny_flags
from tests.inference import _workers

pytestmark = pytest.mark.slow

# np 4, ng 4, nc 2 (virtual heads), hn 16, MoE, 3 steps on mock data.
TINY_RUN = tiny_flags(num_query_groups=4, attention_variant="mea", mea_num_kv_components=2,
                      moe_ffn_hidden_size=32, micro_batch_size=2, global_batch_size=2,
                      train_iters=3, mock_data=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    save = str(root / "mea")
    run_distributed(_workers.pretrain, 1, [*TINY_RUN, "--save", save,
                                           "--data-cache-path", str(root / "cache")])
    return save


def _report(text):
    tokens_per_s = re.search(r"([\d.]+) tokens/s", text)
    kv = re.search(r"KV cache: (\d+) bytes \((\d+) per TP rank\)", text)
    assert tokens_per_s and kv, text
    assert float(tokens_per_s.group(1)) > 0
    return int(kv.group(1)), int(kv.group(2))


def _text(output):
    return output.split("checkpoint:")[0]


def _strip_timing(text):
    return re.sub(r"in [\d.]+ s: .*tokens/s\)", "", text)


def test_greedy_generation_is_deterministic_at_any_tp_and_reports_speed_and_cache(
    checkpoint, tmp_path
):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello\n\nabc\n", encoding="utf-8")
    greedy = ["--load", checkpoint, "--prompt", "Hello", "--max-new-tokens", "12", "--ignore-eod"]
    batched = ["--load", checkpoint + "/iter_0000003", "--prompt-file", str(prompts),
               "--max-new-tokens", "5", "--batch-size", "2", "--ignore-eod"]
    # A world of two: TP=1 runs on two data-parallel replicas, TP=2 shards the model.
    runs = [[*greedy, "--tp", "1"], [*greedy, "--tp", "1"], [*batched, "--tp", "1"],
            [*greedy, "--tp", "2"], [*greedy, "--tp", "1", "--no-stream"],
            ["--load", checkpoint + "/iter_0000009", "--prompt", "x"]]
    outputs = run_distributed(_workers.generate_cli, 2, runs)
    assert [rc for rc, _ in outputs[0]] == [0, 0, 0, 0, 0, 2]  # no such checkpoint: refused, exit 2
    assert all(text == "" for _, text in outputs[1])  # only rank 0 prints
    (_, first), (_, second), (_, batch), (_, tp2), (_, whole), _ = outputs[0]

    assert _strip_timing(first) == _strip_timing(second)  # the same text, token for token
    assert first.startswith("[0] Hello") and "attention_variant=mea, 2 cached" in first
    # K and V x 2 layers x (5 + 12 positions) x 1 row x 2 component heads x hn 16 x fp32, plus
    # the k norm's scalar per position and composite head (2 layers x 17 x 1 x 4 groups x fp32).
    assert _report(first) == (2 * 2 * 17 * 1 * 2 * 16 * 4 + 2 * 17 * 1 * 4 * 4,) * 2
    assert "[0] Hello" in batch and "[1] abc" in batch
    assert _report(batch)[0] == 2 * 2 * (5 + 5) * 2 * 2 * 16 * 4 + 2 * 10 * 2 * 4 * 4

    assert _text(whole) == _text(first)  # streamed pieces add up to the whole text
    assert _text(tp2) == _text(first)  # same greedy text at TP=2
    total, per_rank = _report(tp2)
    assert total == _report(first)[0] and per_rank * 2 == total


def test_a_prompt_past_the_trained_length_gets_one_warning_line(checkpoint):
    # The run was trained at --seq-length 32; ByteLevel gives one token per character.
    base = ["--load", checkpoint, "--max-new-tokens", "2", "--ignore-eod"]
    (short, long_), = run_distributed(_workers.generate_cli_warnings, 1, [
        [*base, "--prompt", "a" * 30], [*base, "--prompt", "a" * 31, "--prompt", "b"]])
    assert short == (0, [])
    code, (line,) = long_
    assert code == 0
    assert line.endswith("warning: prompt 0 (31 tokens) + --max-new-tokens 2 exceeds the "
                         "sequence length the model was trained at (32)"), line


def test_the_export_of_a_byte_level_run_carries_its_tokenizer_and_eod(checkpoint, tmp_path,
                                                                       single_rank):
    """AutoTokenizer loads a byte-level export (lm_eval --model hf needs it) and encodes as
    ByteLevelTokenizer does; `<eod>` is the eos token, so HF generate stops at a document end."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from megatron_mea.checkpoint.hf.exporting import export_hf_checkpoint
    from megatron_mea.data.tokenizers import ByteLevelTokenizer

    export = str(tmp_path / "hf")
    export_hf_checkpoint(checkpoint, export)
    tokenizer = AutoTokenizer.from_pretrained(export)
    text = "h\u00e9llo, w\u00f6rld"
    assert tokenizer(text)["input_ids"] == ByteLevelTokenizer().tokenize(text)
    assert tokenizer.eos_token_id == ByteLevelTokenizer.EOD
    assert tokenizer.decode(ByteLevelTokenizer().tokenize(text)) == text
    config = AutoConfig.from_pretrained(export, trust_remote_code=True)
    assert config.eos_token_id == ByteLevelTokenizer.EOD
    assert GenerationConfig.from_model_config(config).eos_token_id == ByteLevelTokenizer.EOD
