"""Checkpoints written by Megatron-LM's real ``pretrain_gpt.py`` (on CPU, at the installed
megatron-core's tag) export to Hugging Face with no hand-written file, and transformers' logits
equal Megatron's.

And back: the export imported (`mea-convert import-hf`) is a checkpoint Megatron-LM's loop
continues from with `--use-checkpoint-args --no-load-optim`, as it continues the original; and
a `mea-pretrain` checkpoint is one it continues from with its Adam state and data position.

Three runs: MEA with virtual heads and mixed dense/MoE layers at TP=2 + SP (the shared
``mea_tp2_checkpoint``), dense MEA with virtual heads at TP=1, and KHA-MLP with the sigmoid router
and its expert bias (the KHA recipe's router) at TP=1. Megatron's logits are the checkpoint loaded
into Megatron-Core's GPTModel at the TP it was saved at (``load_model``), on the run's world.
"""

import subprocess
import sys

import pytest
import torch

from megatron_mea.checkpoint.hf.exporting import export_hf_checkpoint
from megatron_mea.checkpoint.hf.importing import import_hf_checkpoint
from tests._dist import run_distributed, standalone_environment
from megatron_mea.checkpoint.megatron_lm.reading import read_common_state
from megatron_mea.checkpoint.torch_dist.layerwise import read_checkpoint
from tests.integrations.megatron_lm_cpu import (
    KHA, MEA_VARIANT, MOE, TINY, installed_tag, logged_arg, train)

pytestmark = pytest.mark.slow

ATOL = 1e-4
VOCAB = 256  # NullTokenizer --vocab-size 255 plus its EOD id
# The KHA recipe's router (examples/megatron_lm/kha_moe_6b_a1b.sh): sigmoid scores, an expert
# bias for aux-loss-free balancing, fp32 routing, top-k scaling. The large update rate moves the
# bias far enough in 4 steps that it changes which experts are chosen.
SIGMOID_ROUTER = [
    "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
    "--moe-router-bias-update-rate", "0.1", "--moe-router-load-balancing-type", "none",
    "--moe-router-dtype", "fp32", "--moe-router-topk-scaling-factor", "2.5",
    "--moe-layer-freq", "[1,0]",
]


def _ids(batch=2, seq=12, seed=5):
    return torch.randint(0, 255, (batch, seq), generator=torch.Generator().manual_seed(seed))


def megatron_logits(rank, world_size, root, ids):
    """Worker: the checkpoint's model in Megatron-Core at TP = the world; logits `[b, s, V]`."""
    from megatron_mea.inference import load_model

    model, _ = load_model(root, tp=world_size)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        return model(ids, positions, None, runtime_gather_output=True).float()


@pytest.fixture(scope="module")
def runs(megatron_lm_tree, mea_tp2_checkpoint, tmp_path_factory):
    """(checkpoint, TP it was saved at) of each run, trained lazily."""
    root = tmp_path_factory.mktemp("megatron_lm_export")
    made = {"mea_tp2_mixed_moe": (mea_tp2_checkpoint[0], 2)}
    flags = {
        "mea_dense_virtual_heads": [*TINY, *MEA_VARIANT],
        "kha_mlp_sigmoid_expert_bias": [*TINY, *KHA, *MOE, *SIGMOID_ROUTER],
    }

    def get(name):
        if name not in made:
            checkpoint = root / name
            train(megatron_lm_tree, "pretrain_gpt.py",
                  [*flags[name], "--train-iters", "4", "--save", str(checkpoint),
                   "--save-interval", "4"], iterations=[1, 2, 3, 4])
            made[name] = (checkpoint, 1)
        return made[name]

    return get


def _load_hf(directory):
    import megatron_mea.integrations.transformers  # noqa: F401  (registers the native model types)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory).eval()


@pytest.mark.parametrize("name, hf_class", [
    ("mea_tp2_mixed_moe", "MegatronMEAQwen3MoeForCausalLM"),
    ("mea_dense_virtual_heads", "MegatronMEALlamaForCausalLM"),
    ("kha_mlp_sigmoid_expert_bias", "MegatronMEAQwen3MoeForCausalLM"),
])
def test_real_megatron_lm_checkpoint_exports_with_megatron_logits(runs, name, hf_class, tmp_path,
                                                                  single_rank):
    checkpoint, tp = runs(name)
    assert not (checkpoint / "config.yaml").exists()  # nothing hand-written
    ids = _ids()
    reference = run_distributed(megatron_logits, tp, str(checkpoint), ids)[0]
    out = tmp_path / "hf"
    export_hf_checkpoint(str(checkpoint), str(out))
    model = _load_hf(out)
    assert type(model).__name__ == hf_class
    with torch.no_grad():
        logits = model(ids).logits.float()
    assert logits.shape[-1] == VOCAB
    difference = (logits - reference[..., :VOCAB]).abs().max().item()
    print(f"{name}: max |HF logits - Megatron logits| = {difference:.1e}")
    assert difference < ATOL, difference
    with torch.no_grad():  # generation with the HF cache is greedy decoding without it
        cached = model.generate(ids[:1, :5], max_new_tokens=6, do_sample=False, use_cache=True)
        plain = model.generate(ids[:1, :5], max_new_tokens=6, do_sample=False, use_cache=False)
    assert torch.equal(cached, plain)
    if name == "kha_mlp_sigmoid_expert_bias":
        # The expert bias is the checkpoint's tensor, exported as it is.
        bias = model.model.layers[0].mlp.gate.expert_bias
        _, layers = read_checkpoint(str(checkpoint))
        saved = dict(layers)[0]["decoder.layers.0.mlp.router.expert_bias"]
        torch.testing.assert_close(bias, saved.float(), atol=0, rtol=0)
        if installed_tag() == "core_v0.16.1":
            # Megatron-LM 0.16's loop moves it in these 4 steps (0.19's leaves it at zero on
            # this CPU run; the moved-bias case is tests/checkpoint/test_megatron_lm_checkpoints
            # .py's), and it routes: zeroed, the logits move.
            assert bias.abs().max() > 0.05, bias
            with torch.no_grad():
                bias.zero_()
                unbiased = model(ids).logits.float()
            assert (unbiased - reference[..., :VOCAB]).abs().max() > 1e-3


def test_an_imported_checkpoint_continues_in_megatron_lm_like_the_original(
        runs, megatron_lm_tree, tmp_path):
    checkpoint, _ = runs("mea_dense_virtual_heads")
    hf, imported = tmp_path / "hf", tmp_path / "imported"
    export_hf_checkpoint(str(checkpoint), str(hf))
    import_hf_checkpoint(str(hf), str(imported))
    # No variant flags: --use-checkpoint-args restores MEA from the saved arguments. The import
    # has no optimizer state (--no-load-optim); the original is taken with a fresh optimizer and
    # its iteration reset (--finetune), so both runs start from the same weights and data.
    flags = [*TINY, "--use-checkpoint-args", "--train-iters", "2"]
    continued = train(megatron_lm_tree, "pretrain_gpt.py",
                      [*flags, "--no-load-optim", "--load", str(imported)], iterations=[1, 2])
    original = train(megatron_lm_tree, "pretrain_gpt.py",
                     [*flags, "--finetune", "--load", str(checkpoint)], iterations=[1, 2])
    assert logged_arg(continued, "attention_variant") == "mea"
    assert logged_arg(continued, "mea_num_kv_components") == "2"
    print(f"imported: losses {continued.losses}; original: {original.losses}")
    assert continued.losses == original.losses


def test_megatron_lm_continues_a_mea_pretrain_checkpoint_with_its_optimizer(
        megatron_lm_tree, tmp_path):
    # TINY's model (dense MEA with virtual heads, 255 NullTokenizer ids -> 256 rows) trained by
    # mea-pretrain for 2 iterations of 4 samples.
    run = tmp_path / "run"
    command = [
        sys.executable, "-m", "megatron_mea.cli.pretrain", "--num-layers", "2",
        "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
        "--num-query-groups", "4", "--seq-length", "32", "--num-experts", "0",
        "--no-qk-layernorm", "--vocab-size", "255", "--mock-data", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--train-iters", "2", "--save", str(run),
        *MEA_VARIANT, "--no-progress-bar", "--eval-iters", "0",
    ]
    env = standalone_environment(PYTHONWARNINGS="ignore")
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    # Megatron-LM's scheduler counts samples where mea-pretrain's counts iterations: the run
    # states its own schedule (docs/megatron-lm.md, "From Hugging Face or mea-pretrain back to Megatron-LM").
    # The same --lr / --min-lr as the run (mea-pretrain's default min-lr, 1e-4): from
    # megatron-core 0.17 Megatron matches the optimizer's parameter groups by them.
    continued = train(megatron_lm_tree, "pretrain_gpt.py",
                      [*TINY, "--min-lr", "1e-4", "--use-checkpoint-args",
                       "--override-opt_param-scheduler", "--load", str(run), "--train-iters", "4", "--save", str(tmp_path / "mlm"),
                       "--save-interval", "4"], iterations=[3, 4])
    assert logged_arg(continued, "attention_variant") == "mea"
    saved = read_common_state(str(tmp_path / "mlm" / "iter_0000004"))
    # Adam's step went on from mea-pretrain's 2 (a fresh optimizer would say 2), and the data
    # from its 8 samples.
    steps = [value for key, value in _leaves(saved["optimizer"]) if key == "common_step"]
    assert steps and all(float(step) == 4 for step in steps), steps
    assert saved["args"].consumed_train_samples == 16


def _leaves(tree):
    if isinstance(tree, dict):
        for key, value in tree.items():
            if isinstance(value, (dict, list)):
                yield from _leaves(value)
            else:
                yield key, value
    elif isinstance(tree, list):
        for value in tree:
            yield from _leaves(value)
