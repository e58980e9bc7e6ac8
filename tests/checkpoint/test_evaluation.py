"""`mea-eval`: lm-evaluation-harness on the HF export of a checkpoint, on a local YAML task
(tests/eval_task: no dataset hub), checked against the same log-likelihoods computed directly
from the Megatron model."""

import json
from pathlib import Path

import pytest
import torch

from megatron_mea.checkpoint.hf.importing import import_hf_checkpoint
from tests.checkpoint._hf_models import build_hf_model, save_hf_model
from tests.checkpoint._megatron import megatron_logits, perturb_plugin_params

# The lm-eval harness on an export: application code, the same on every Megatron-Core release;
# tested with one.
pytestmark = pytest.mark.one_release("0.16")

REPO = Path(__file__).resolve().parents[2]
TASK_DIR = REPO / "tests" / "eval_task"
TASK = "mea_local_choice"


def _offline(monkeypatch, tmp_path):
    # The harness loads the JSONL through `datasets`' json builder: nothing may reach a hub.
    monkeypatch.chdir(tmp_path)  # any directory: the task's data path is relative to its folder
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))


def _byte_model(tmp_path, variant, **options):
    """A tiny Qwen3 over the byte vocabulary (257 ids), imported as `variant`, plugin
    parameters perturbed."""
    hf_dir = save_hf_model(build_hf_model("qwen3", vocab_size=257), str(tmp_path / "hf_src"))
    imported = str(tmp_path / f"{variant}-imported")
    import_hf_checkpoint(hf_dir, imported, attention_variant=variant, **options)
    return perturb_plugin_params(imported, str(tmp_path / variant))


def _direct_log_likelihoods(checkpoint, context, choices):
    """Sum of log p(" choice" bytes | context bytes) per choice, from the Megatron model."""
    scores = []
    for choice in choices:
        prompt = list(context.encode("utf-8"))
        ids = prompt + list((" " + choice).encode("utf-8"))
        logits = megatron_logits(checkpoint, torch.tensor([ids]))[0]
        logprobs = torch.log_softmax(logits.double(), dim=-1)
        scores.append(sum(logprobs[i - 1, ids[i]].item() for i in range(len(prompt), len(ids))))
    return scores


@pytest.mark.parametrize("variant,options", [("mea", {"mea_head_norm": True}),
                                             ("kha", {"kha_variant": "mlp"})],
                         ids=["mea-native", "kha-mlp-native"])
def test_harness_scores_equal_the_direct_log_likelihoods(single_rank, tmp_path, monkeypatch,
                                                         variant, options):
    from megatron_mea.apps.evaluation import evaluate_checkpoint

    _offline(monkeypatch, tmp_path)
    checkpoint = _byte_model(tmp_path, variant, **options)
    results = evaluate_checkpoint(checkpoint, [TASK], include_path=str(TASK_DIR),
                                  tokenizer="byte-level", export_dir=str(tmp_path / "export"),
                                  log_samples=True)
    assert (tmp_path / "export" / "modeling_megatron_mea.py").exists()  # the native export
    samples = results["samples"][TASK]
    assert len(samples) == 6
    correct = []
    for sample in samples:
        doc = sample["doc"]
        harness = [float(ll) for ll, _ in sample["filtered_resps"]]
        direct = _direct_log_likelihoods(checkpoint, doc["context"], doc["choices"])
        assert harness == pytest.approx(direct, abs=1e-4, rel=1e-5), doc
        correct.append(max(range(len(direct)), key=direct.__getitem__) == doc["label"])
    assert results["results"][TASK]["acc,none"] == pytest.approx(sum(correct) / len(correct))


def test_cli_refuses_a_checkpoint_without_a_tokenizer(single_rank, tmp_path, capsys):
    from megatron_mea.cli.evaluate import main

    hf_dir = save_hf_model(build_hf_model("llama"), str(tmp_path / "hf_src"))
    imported = str(tmp_path / "imported")
    import_hf_checkpoint(hf_dir, imported)
    assert main(["--load", imported, "--tasks", TASK, "--include-path", str(TASK_DIR)]) == 2
    error = capsys.readouterr().err
    assert "has no tokenizer files and the model is not a byte-level one" in error
    assert main(["--load", imported, "--tasks", TASK, "--tokenizer", "byte-level"]) == 2
    assert "needs a vocabulary of >= 257 ids" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_loads_an_older_checkpoint_by_step_or_by_folder(single_rank, tmp_path, monkeypatch,
                                                           capsys):
    """The hint of a corrupt newest checkpoint (`pass --ckpt-step 0`) is a flag mea-eval takes,
    as mea-generate and mea-convert do; its `iter_XXXXXXX` folder as --load is the same."""
    import shutil

    from megatron_mea.cli.evaluate import main

    _offline(monkeypatch, tmp_path)
    checkpoint = Path(_byte_model(tmp_path, "mea", mea_head_norm=True))
    older = checkpoint / "iter_0000000"
    newest = checkpoint / "iter_0000010"
    shutil.copytree(older, newest)
    (checkpoint / "latest_checkpointed_iteration.txt").write_text("10")
    shard = sorted(newest.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:-1])  # truncated: a corrupt newest checkpoint
    task = ["--tasks", TASK, "--include-path", str(TASK_DIR), "--tokenizer", "byte-level"]

    assert main(["--load", str(checkpoint), *task]) == 2
    assert "pass --ckpt-step 0 to load it instead" in capsys.readouterr().err
    accuracies = []
    for load in (["--load", str(checkpoint), "--ckpt-step", "0"],
                 ["--load", f"{older}/", "--iteration", "0"]):
        output = tmp_path / "results.json"
        assert main([*load, *task, "--limit", "2", "--output-path", str(output)]) == 0, load
        accuracies.append(json.loads(output.read_text())[TASK]["acc,none"])
    assert accuracies[0] == accuracies[1]
    assert main(["--load", str(older), "--ckpt-step", "10", *task]) == 2
    assert capsys.readouterr().err.strip().endswith(
        f"--ckpt-step 10 contradicts the checkpoint path {older}")
