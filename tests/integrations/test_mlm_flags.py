"""The vendored Megatron-LM flag tables: one per tag, labelled, picked by megatron-core version."""

import argparse
import json

import pytest

from megatron_mea.compat import MEGATRON_CORE_VERSION
from megatron_mea.integrations.mlm_flags import (
    MEGATRON_LM_TAGS,
    build_parser,
    describe_parser,
    flags_file,
    installed_tag,
    load_flags,
    tag_for_core_version,
)

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8"]


@pytest.mark.parametrize(
    "version,tag",
    [("0.16.0", "core_v0.16.1"), ("0.16.1", "core_v0.16.1"), ("0.17.0", "core_v0.19.0"),
     ("0.19.2", "core_v0.19.0"), ("0.19.0rc1", "core_v0.19.0"), ("0.21.0", "core_v0.19.0")],
)
def test_tag_for_core_version(version, tag):
    assert tag_for_core_version(version) == tag


def test_older_megatron_core_has_no_table():
    with pytest.raises(ValueError, match=r"megatron-core 0\.15\.2 is older than 0\.16"):
        tag_for_core_version("0.15.2")


def test_installed_tag_follows_megatron_core():
    assert installed_tag() == tag_for_core_version(MEGATRON_CORE_VERSION)
    assert load_flags()["tag"] == installed_tag()


def test_unknown_tag_is_named():
    with pytest.raises(ValueError, match=r"unknown Megatron-LM tag 'core_v0\.18\.0'"):
        load_flags("core_v0.18.0")


@pytest.mark.parametrize("tag", sorted(MEGATRON_LM_TAGS))
def test_each_table_records_its_tag_and_commit(tag):
    with open(flags_file(tag)) as f:
        table = json.load(f)
    assert (table["tag"], table["commit"]) == (tag, MEGATRON_LM_TAGS[tag])
    assert tag_for_core_version(table["megatron_core_version"]) == tag
    options = [flag for rec in table["flags"] for flag in rec["flags"]]
    assert len(table["flags"]) > 600 and len(set(options)) == len(options)


def test_defaults_are_the_tags_own():
    # core_v0.19.0 deprecated the per-backend SM counts (None; two different values now raise
    # in TransformerConfig) and dropped the legacy models.
    old, new = (build_parser(load_flags(tag)).parse_args(MODEL) for tag in sorted(MEGATRON_LM_TAGS))
    assert (old.moe_deepep_num_sms, old.moe_hybridep_num_sms) == (20, 16)
    assert (new.moe_deepep_num_sms, new.moe_hybridep_num_sms) == (None, None)
    assert old.use_legacy_models is False and not hasattr(new, "use_legacy_models")


@pytest.mark.parametrize("tag", sorted(MEGATRON_LM_TAGS))
def test_rebuilt_parser_checks_values_like_megatron(tag):
    parser = build_parser(load_flags(tag))
    args = parser.parse_args(MODEL + ["--moe-layer-freq", "([0]*1+[1]*1)", "--bf16"])
    assert args.moe_layer_freq == [0, 1] and args.bf16
    with pytest.raises(SystemExit):
        parser.parse_args(MODEL + ["--num-layers", "two"])
    with pytest.raises(SystemExit):
        parser.parse_args(MODEL + ["--position-embedding-type", "alibi"])


def test_describe_parser_refuses_an_action_it_cannot_rebuild():
    parser = argparse.ArgumentParser()
    parser.add_argument("--verbose", action="count")
    with pytest.raises(ValueError, match=r"--verbose uses argparse action _CountAction"):
        describe_parser(parser)
