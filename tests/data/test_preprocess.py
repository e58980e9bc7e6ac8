"""Preprocessing: exact token ids on disk, bad inputs reported by file:line, atomic writes."""

import json
import os

import numpy
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_mea.data import ByteLevelTokenizer, PreprocessError, preprocess_files

EOD = ByteLevelTokenizer.EOD


def _ids(text):
    return list(text.encode("utf-8"))


def _write(path, data):
    path.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
    return str(path)


def _read_all(prefix):
    dataset = IndexedDataset(prefix)
    return [dataset[i].tolist() for i in range(len(dataset))], dataset


@pytest.fixture
def tok():
    return ByteLevelTokenizer()


def test_jsonl_and_txt_become_the_expected_token_ids(tmp_path, tok):
    jsonl = _write(
        tmp_path / "a.jsonl",
        json.dumps({"text": "hi", "id": 1})
        + "\n"
        + json.dumps({"text": "caf\u00e9 \u4e2d"})
        + "\n",
    )
    txt = _write(tmp_path / "b.txt", "line one\nline two\n")
    prefix = str(tmp_path / "out" / "ds")

    summary = preprocess_files([jsonl, txt], prefix, tok, append_eod=True, progress=False)

    docs, dataset = _read_all(prefix)
    expected = [
        _ids("hi") + [EOD],
        _ids("caf\u00e9 \u4e2d") + [EOD],
        _ids("line one\nline two\n") + [EOD],
    ]
    assert docs == expected
    assert dataset.index.dtype == numpy.uint16
    assert (summary.documents, summary.tokens, summary.errors) == (3, sum(map(len, expected)), [])
    assert summary.written and summary.files == [jsonl, txt]
    assert sorted(os.listdir(tmp_path / "out")) == ["ds.bin", "ds.idx"]


def test_without_append_eod_no_eod_is_written(tmp_path, tok):
    txt = _write(tmp_path / "doc.md", "abc")
    preprocess_files([txt], str(tmp_path / "ds"), tok, progress=False)
    assert _read_all(str(tmp_path / "ds"))[0] == [_ids("abc")]


def test_each_malformed_input_is_reported_with_file_and_line_and_good_lines_survive(tmp_path, tok):
    lines = [
        json.dumps({"text": "good one"}).encode(),  # 1
        b"{not json",  # 2
        json.dumps({"body": "x"}).encode(),  # 3: missing field
        json.dumps({"text": 42}).encode(),  # 4: not a string
        b'["a list"]',  # 5: not an object
        b'{"text": "bad \xff byte"}',  # 6: invalid UTF-8
        b"",  # 7: blank, not a document
        b'{"text": "\\ud800"}',  # 8: lone surrogate
        json.dumps({"text": ""}).encode(),  # 9: empty document
        json.dumps({"text": "good two"}).encode(),  # 10
    ]
    jsonl = _write(tmp_path / "mixed.jsonl", b"\n".join(lines) + b"\n")
    bad_txt = _write(tmp_path / "bad.txt", b"fine first line\nsecond \xfe line\n")

    summary = preprocess_files([jsonl, bad_txt], str(tmp_path / "ds"), tok, progress=False)

    assert [e.split(": ", 1)[0] for e in summary.errors] == [
        f"{jsonl}:2",
        f"{jsonl}:3",
        f"{jsonl}:4",
        f"{jsonl}:5",
        f"{jsonl}:6",
        f"{jsonl}:8",
        f"{bad_txt}:2",
    ]
    messages = [e.split(": ", 1)[1] for e in summary.errors]
    assert messages[0].startswith("invalid JSON")
    assert messages[1] == "missing text field 'text'"
    assert messages[2] == "text field 'text' is int, expected a string"
    assert messages[3] == "expected a JSON object, got list"
    assert messages[4].startswith("invalid UTF-8")
    assert messages[5].startswith("text is not valid Unicode")
    assert messages[6].startswith("invalid UTF-8")
    assert summary.empty_documents == 1
    assert summary.documents == 2 and summary.written
    assert _read_all(str(tmp_path / "ds"))[0] == [_ids("good one"), _ids("good two")]


def test_errors_are_logged_as_warnings(tmp_path, tok, caplog):
    jsonl = _write(tmp_path / "x.jsonl", '{"text": "ok"}\n{oops\n')
    preprocess_files([jsonl], str(tmp_path / "ds"), tok, progress=False)
    assert f"{jsonl}:2: invalid JSON" in caplog.text


def test_custom_json_key_and_utf8_bom(tmp_path, tok):
    jsonl = _write(tmp_path / "k.jsonl", b"\xef\xbb\xbf" + json.dumps({"content": "x"}).encode())
    summary = preprocess_files(
        [jsonl], str(tmp_path / "ds"), tok, json_key="content", progress=False
    )
    assert summary.errors == [] and _read_all(str(tmp_path / "ds"))[0] == [_ids("x")]


def test_nothing_is_published_when_no_document_is_written(tmp_path, tok):
    jsonl = _write(tmp_path / "bad.jsonl", "nope\n")
    summary = preprocess_files([jsonl], str(tmp_path / "ds"), tok, progress=False)
    assert (summary.documents, summary.written, len(summary.errors)) == (0, False, 1)
    assert summary.why_empty() == f"{jsonl}: no documents (1 malformed inputs skipped)"
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]


# mea-preprocess's own handling of a full disk: one release (no Megatron-Core beneath it).
@pytest.mark.one_release("0.16")
def test_a_full_disk_is_one_line_naming_the_output_and_leaves_nothing(tmp_path, capsys,
                                                                      tool_logging):
    # It printed "error: [Errno 28] No space left on device" naming neither the tool nor the
    # file, and left the partial .bin behind (the close's flush failed too). The disk fills in
    # the middle of the .bin (a file-size limit: EFBIG, as a full disk gives ENOSPC).
    from tests._limits import file_size_limit

    cli = _load_cli()
    corpus = _write(tmp_path / "c.jsonl", "".join(json.dumps({"text": f"document {i} " * 40})
                                                  + "\n" for i in range(40)))
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with file_size_limit(8192):
        rc = cli.main(["--input", corpus, "--output-prefix", str(out_dir / "ds"),
                       "--tokenizer-type", "ByteLevelTokenizer", "--no-progress"])
    assert rc == 1
    assert capsys.readouterr().err == (
        f"mea-preprocess: error: {out_dir / 'ds'}.bin/.idx: file size limit reached (ulimit -f); "
        "nothing written (the partial output was removed)\n")
    assert os.listdir(out_dir) == []


def test_strict_mode_writes_nothing_and_raises_with_every_error(tmp_path, tok):
    jsonl = _write(tmp_path / "s.jsonl", '{"text": "ok"}\n[]\n')
    with pytest.raises(PreprocessError, match="s.jsonl:2") as info:
        preprocess_files([jsonl], str(tmp_path / "ds"), tok, strict=True, progress=False)
    assert info.value.summary.documents == 1 and not info.value.summary.written
    assert sorted(os.listdir(tmp_path)) == ["s.jsonl"]


class _CrashingTokenizer(ByteLevelTokenizer):
    def tokenize(self, text):
        if text == "boom":
            raise RuntimeError("crash mid-run")
        return super().tokenize(text)


def test_a_crash_keeps_the_previous_dataset_and_leaves_no_partial_files(tmp_path, tok):
    prefix = str(tmp_path / "out" / "ds")
    first = _write(tmp_path / "first.txt", "old dataset")
    preprocess_files([first], prefix, tok, progress=False)
    crashing = _write(tmp_path / "c.jsonl", '{"text": "fine"}\n{"text": "boom"}\n')

    with pytest.raises(RuntimeError, match="crash mid-run"):
        preprocess_files([crashing], prefix, _CrashingTokenizer(), progress=False)

    assert sorted(os.listdir(tmp_path / "out")) == ["ds.bin", "ds.idx"]
    assert _read_all(prefix)[0] == [_ids("old dataset")]


class _WideTokenizer(ByteLevelTokenizer):
    @property
    def vocab_size(self):
        return 70_000


def test_large_vocabularies_are_stored_as_int32(tmp_path):
    txt = _write(tmp_path / "t.txt", "ab")
    preprocess_files([txt], str(tmp_path / "ds"), _WideTokenizer(), append_eod=True, progress=False)
    docs, dataset = _read_all(str(tmp_path / "ds"))
    assert dataset.index.dtype == numpy.int32 and docs == [_ids("ab") + [EOD]]


def test_bad_arguments_fail_before_writing(tmp_path, tok):
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        preprocess_files([str(tmp_path / "nope.txt")], str(tmp_path / "ds"), tok)
    with pytest.raises(ValueError, match="--output-prefix"):
        preprocess_files([], str(tmp_path / "ds.bin"), tok)
    assert os.listdir(tmp_path) == []


def _load_cli():
    from megatron_mea.cli import preprocess

    return preprocess


def test_cli_exit_codes_and_summary(tmp_path, capsys, tool_logging):
    cli = _load_cli()
    _write(tmp_path / "a.jsonl", '{"text": "one"}\n{broken\n')
    _write(tmp_path / "b.jsonl", '{"text": "two"}\n')
    common = ["--tokenizer-type", "ByteLevelTokenizer", "--no-progress"]

    rc = cli.main(
        [
            "--input",
            str(tmp_path / "*.jsonl"),
            "--output-prefix",
            str(tmp_path / "o" / "ds"),
            "--append-eod",
            *common,
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "documents written: 2" in out and "tokens written: 8" in out
    assert f"{tmp_path / 'a.jsonl'}:2: invalid JSON" in out
    assert _read_all(str(tmp_path / "o" / "ds"))[0] == [_ids("one") + [EOD], _ids("two") + [EOD]]

    rc = cli.main(
        [
            "--input",
            str(tmp_path / "a.jsonl"),
            "--output-prefix",
            str(tmp_path / "s"),
            "--strict",
            *common,
        ]
    )
    assert rc == 2 and not os.path.exists(tmp_path / "s.bin")

    capsys.readouterr()
    empty = _write(tmp_path / "empty.jsonl", "\n")
    rc = cli.main(["--input", empty, "--output-prefix", str(tmp_path / "e"), *common])
    out, err = capsys.readouterr()
    # It said "dataset written: nothing (see above)" with nothing above.
    assert rc == 1 and out.endswith(f"dataset written: nothing ({empty}: no documents)\n")
    assert err == f"mea-preprocess: error: {empty}: no documents; nothing written\n"

    with pytest.raises(SystemExit) as info:
        cli.main(["--input", str(tmp_path / "*.none"), "--output-prefix", "x", *common])
    assert info.value.code == 2


# Every flag of Megatron-LM's tools/preprocess_data.py besides its tokenizer's (its get_args, on
# main after core_v0.19.0, a superset of core_v0.16.1's), with a value where it takes one.
MEGATRON_LM_FLAGS = [
    "--json-keys", "text", "--split-sentences", "--keep-newlines", "--append-eod",
    "--lang", "english", "--workers", "4", "--find-optimal-num-workers",
    "--workers-to-check", "16", "32", "--max-documents", "100", "--performance-dir", "perf",
    "--partitions", "1", "--log-interval", "2", "--keep-sequential-samples",
]


# The command line of Megatron-LM's preprocess tool, parsed by mea-preprocess: one release.
@pytest.mark.one_release("0.16")
def test_a_megatron_lm_command_line_runs_unchanged(tmp_path, capsys, caplog,
                                                   tool_logging):
    # `--workers` (which Megatron-LM's tool requires), --log-interval, --partitions,
    # --keep-newlines and --split-sentences were refused as unrecognized arguments.
    import logging

    cli = _load_cli()
    corpus = _write(tmp_path / "c.jsonl", "".join(json.dumps({"text": f"doc {i}."}) + "\n"
                                                  for i in range(5)))
    common = ["--input", corpus, "--tokenizer-type", "ByteLevelTokenizer", "--no-progress"]
    with caplog.at_level(logging.INFO, logger="megatron_mea.data.preprocess"):
        assert cli.main([*common, "--output-prefix", str(tmp_path / "mlm"),
                         *MEGATRON_LM_FLAGS]) == 0
    # The tool's own lines (what earlier tests' loggers may add to stderr is not the tool's).
    err = "\n".join(line for line in capsys.readouterr().err.splitlines()
                    if line.startswith("mea-preprocess"))
    assert err.count("mea-preprocess: ignored: ") == 1 and len(err.splitlines()) == 1
    for flag in ("--workers", "--partitions", "--split-sentences", "--keep-newlines", "--lang",
                 "--find-optimal-num-workers", "--keep-sequential-samples"):
        assert f" {flag} (" in err, flag
    # --log-interval is honoured: a line every 2 documents, as Megatron-LM's tool prints.
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("processed")]
    assert [line.split(" (")[0] for line in progress] == ["processed 2 documents",
                                                          "processed 4 documents"]
    # The same dataset as without Megatron-LM's flags.
    assert cli.main([*common, "--output-prefix", str(tmp_path / "plain"), "--append-eod"]) == 0
    assert _read_all(str(tmp_path / "mlm"))[0] == _read_all(str(tmp_path / "plain"))[0]
    assert "mea-preprocess" not in capsys.readouterr().err
