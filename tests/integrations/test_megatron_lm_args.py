"""The plugin's flags are generated from MEATransformerConfig and round-trip flag -> args -> config."""

import argparse
import dataclasses
import subprocess
import sys

import pytest
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_mea import MEATransformerConfig
from megatron_mea.integrations.args import (
    RUNTIME_FIELDS,
    add_mea_args,
    flag_name,
    mea_config_kwargs,
    plugin_fields,
    restore_mea_args,
)
from megatron_mea.integrations.mlm_flags import build_parser

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8",
         "--group-query-attention", "--num-query-groups", "4"]


def megatron_parser():
    return add_mea_args(build_parser())


def config_from_args(args):
    """What core_transformer_config_from_args does: copy every args attribute naming a field."""
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(MEATransformerConfig)
          if hasattr(args, f.name) and f.name in {"num_layers", "hidden_size",
                                                   "num_attention_heads"}}
    kw["num_query_groups"] = args.num_query_groups
    kw.update(mea_config_kwargs(args))
    return MEATransformerConfig(**kw)


def test_every_plugin_field_has_a_flag_whose_dest_is_the_field_name():
    parser = megatron_parser()
    by_dest = {a.dest: a for a in parser._actions}
    base = {f.name for f in dataclasses.fields(TransformerConfig)}
    added = [f.name for f in dataclasses.fields(MEATransformerConfig) if f.name not in base]
    assert sorted(f.name for f in plugin_fields()) == sorted(added)
    for field in plugin_fields():
        assert flag_name(field.name) in by_dest[field.name].option_strings
        assert by_dest[field.name].default == field.default
        assert by_dest[field.name].help, f"{field.name} has no help text (field docstring)"


def test_choices_come_from_the_literal_annotations():
    parser = megatron_parser()
    by_dest = {a.dest: a for a in parser._actions}
    assert tuple(by_dest["attention_variant"].choices) == ("standard", "mea", "kha")
    assert tuple(by_dest["kha_variant"].choices) == ("linear", "mlp", "gate")
    assert tuple(by_dest["kha_init"].choices) == ("identity", "random")
    with pytest.raises(SystemExit):
        parser.parse_args(MODEL + ["--attention-variant", "mla"])


@pytest.mark.parametrize(
    "flags,expected",
    [
        ([], dict(attention_variant="standard")),
        (["--attention-variant", "mea", "--mea-num-kv-components", "2", "--mea-mix-init",
          "normal", "--no-mea-head-norm", "--mea-tp-exchange", "activations"],
         dict(attention_variant="mea", mea_num_kv_components=2, mea_mix_init="normal",
              mea_head_norm=False, mea_tp_exchange="activations")),
        (["--attention-variant", "mea", "--mea-head-norm"],
         dict(attention_variant="mea", mea_num_kv_components=None, mea_head_norm=True)),
        (["--attention-variant", "mea", "--mea-num-kv-components-per-layer", "2", "4"],
         dict(attention_variant="mea", mea_num_kv_components_per_layer=(2, 4))),
        (["--attention-variant", "kha", "--kha-variant", "linear", "--kha-targets", "q", "k"],
         dict(attention_variant="kha", kha_variant="linear", kha_targets=("q", "k"))),
        (["--attention-variant", "kha", "--kha-variant", "mlp", "--kha-targets", "v"],
         dict(attention_variant="kha", kha_variant="mlp", kha_targets=("v",))),
    ],
    ids=["standard", "mea-virtual", "mea-default", "mea-per-layer", "kha-linear-qk", "kha-mlp"],
)
def test_flags_round_trip_to_config(flags, expected):
    args = megatron_parser().parse_args(MODEL + flags)
    for name, value in expected.items():
        assert getattr(args, name) == value, name
    config = config_from_args(args)
    for field in plugin_fields():
        if getattr(args, field.name) is not None:  # None fields get defaults by shape
            assert getattr(config, field.name) == getattr(args, field.name), field.name


def test_add_mea_args_works_without_megatron_training():
    # A fresh interpreter: another test of this session may have imported megatron.training.
    code = ("import argparse, sys\n"
            "from megatron_mea.integrations.args import add_mea_args\n"
            "add_mea_args(argparse.ArgumentParser())\n"
            "assert 'megatron.training' not in sys.modules, 'megatron.training was imported'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr


def test_restore_takes_model_fields_from_the_checkpoint_and_keeps_runtime_ones():
    args = megatron_parser().parse_args(MODEL + ["--mea-tp-exchange", "activations"])
    saved = argparse.Namespace(attention_variant="mea", mea_num_kv_components=2,
                               mea_head_norm=False, mea_tp_exchange="weights")
    changed = restore_mea_args(args, saved)
    assert args.attention_variant == "mea" and args.mea_num_kv_components == 2
    assert args.mea_head_norm is False
    assert args.mea_tp_exchange == "activations"  # a runtime choice, not restored
    assert "mea_tp_exchange" in RUNTIME_FIELDS
    assert {name for name, _, _ in changed} == {"attention_variant", "mea_num_kv_components",
                                                "mea_head_norm"}


def test_restore_keeps_command_line_for_a_baseline_checkpoint():
    args = megatron_parser().parse_args(MODEL + ["--attention-variant", "kha"])
    baseline_saved = argparse.Namespace(num_layers=2, hidden_size=64)  # saved before the plugin
    assert restore_mea_args(args, baseline_saved) == []
    assert args.attention_variant == "kha"
    assert restore_mea_args(args, None) == []
