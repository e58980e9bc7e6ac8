"""`mea-pretrain` arguments: YAML + flags, Megatron-LM names, validated before anything starts."""

import pytest
import yaml

from megatron_mea.apps.training.arguments import PretrainArgs, build_parser, parse_args
from megatron_mea.model.run_config import save_config

MOCK = ["--mock-data", "--vocab-size", "128"]


def test_flags_use_megatron_lm_names_and_override_yaml(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"hidden-size": 64, "num_attention_heads": 4, "lr": 1e-3,
                                      "attention-variant": "mea"}))
    args = parse_args(["--config", str(config), "--lr", "3e-3", "--tensor-model-parallel-size",
                       "1", "--no-qk-layernorm", *MOCK])
    assert (args.hidden_size, args.num_attention_heads, args.lr) == (64, 4, 3e-3)
    assert args.attention_variant == "mea" and args.qk_layernorm is False


def test_every_field_has_a_flag():
    flags = {a.dest for a in build_parser()._actions}
    assert {f for f in PretrainArgs.__dataclass_fields__} <= flags


def test_config_is_saved_and_reloads_to_the_same_arguments(tmp_path):
    args = parse_args(["--attention-variant", "kha", "--kha-variant", "linear", "--kha-targets", "q",
                       "v", *MOCK])
    path = save_config(args, str(tmp_path))
    assert parse_args(["--config", path]) == args


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--global-batch-size", "6", "--micro-batch-size", "4", *MOCK],
         r"global_batch_size \(6\) must be divisible by micro_batch_size \(4\)"),
        ([], r"data_path is required unless mock_data"),
        (["--data-path", "/nonexistent/prefix"], r"no dataset at '/nonexistent/prefix'"),
        (["--attention-variant", "mea", "--mea-num-kv-components", "3", *MOCK],
         r"mea_num_kv_components \(3\)"),
        (["--tensor-model-parallel-size", "2", *MOCK], r"world size \(1\) must be divisible"),
        (["--min-lr", "1", "--lr", "0.1", *MOCK], r"min_lr \(1.0\) must not exceed lr"),
        (["--lr-warmup-fraction", "1.5", *MOCK], r"lr_warmup_fraction \(1.5\)"),
        (["--save-interval", "10", *MOCK], r"save_interval needs save"),
        (["--train-iters", "0", *MOCK], r"train_iters \(0\) must be >= 1"),
        (["--eval-iters", "-1", *MOCK], r"eval_iters \(-1\) must be >= 0 \(0: no evaluation\)"),
        (["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler", *MOCK],
         r"override_opt_param_scheduler and use_checkpoint_opt_param_scheduler are exclusive"),
        (["--dist-ckpt-optim-fully-reshardable", *MOCK],
         r"dist_ckpt_optim_fully_reshardable needs use_distributed_optimizer"),
        (["--num-layers-per-virtual-pipeline-stage", "1", *MOCK],
         r"num_layers_per_virtual_pipeline_stage needs pipeline_model_parallel_size > 1"),
    ],
)
def test_invalid_arguments_raise_value_error_naming_the_flag(argv, match):
    with pytest.raises(ValueError, match=match):
        parse_args(argv)


def test_yaml_errors_name_the_file_and_key(tmp_path):
    bad_key = tmp_path / "a.yaml"
    bad_key.write_text("hiden-size: 64\n")
    with pytest.raises(ValueError, match=r"a.yaml: unknown setting 'hiden-size'"):
        parse_args(["--config", str(bad_key), *MOCK])
    bad_type = tmp_path / "b.yaml"
    bad_type.write_text("num-layers: four\n")
    with pytest.raises(ValueError, match=r"b.yaml: num-layers: expected int, got 'four'"):
        parse_args(["--config", str(bad_type), *MOCK])
    bad_choice = tmp_path / "c.yaml"
    bad_choice.write_text("attention-variant: mla\n")
    with pytest.raises(ValueError, match=r"attention_variant \('mla'\) must be one of"):
        parse_args(["--config", str(bad_choice), *MOCK])


def test_bad_flag_value_is_an_argparse_error():
    with pytest.raises(SystemExit):
        parse_args(["--attention-variant", "mla"])


def test_moe_layer_pattern_and_hf_derived_fields(tmp_path):
    args = parse_args(["--num-layers", "3", "--moe-layer-freq", "[0,1,1]", "--rotary-base",
                       "1e6", "--layernorm-epsilon", "1e-6", "--add-qkv-bias", *MOCK])
    assert args.moe_layer_freq == [0, 1, 1] and args.rotary_base == 1e6
    config = tmp_path / "run.yaml"
    config.write_text("num-layers: 2\nmoe-layer-freq: [1, 0]\n")
    assert parse_args(["--config", str(config), *MOCK]).moe_layer_freq == [1, 0]
    bad = tmp_path / "bad.yaml"
    bad.write_text("moe-layer-freq: [0, 2]\n")
    with pytest.raises(ValueError, match=r"moe_layer_freq: expected an int or a list of 0/1"):
        parse_args(["--config", str(bad), *MOCK])
    with pytest.raises(SystemExit):  # argparse reports a bad flag value itself
        parse_args(["--moe-layer-freq", "[0,2]", *MOCK])


def test_negative_switches_are_switches():
    # `--no-load-optim` and the like store True (argparse's BooleanOptionalAction would read the
    # leading "no-" as a negation and store False); `--no-qk-layernorm` still negates.
    args = parse_args(["--no-load-optim", "--no-load-rng", "--no-progress-bar",
                       "--no-decay-plugin-matrices", "--no-qk-layernorm", *MOCK])
    assert args.no_load_optim and args.no_load_rng and args.no_progress_bar
    assert args.no_decay_plugin_matrices and args.qk_layernorm is False
    plain = parse_args(MOCK)
    assert not (plain.no_load_optim or plain.no_load_rng or plain.no_decay_plugin_matrices)


def test_scheduler_flags_take_megatron_lm_s_spellings():
    for flag in ("--override-opt_param-scheduler", "--override-opt-param-scheduler"):
        args = parse_args([flag, *MOCK])
        assert args.override_opt_param_scheduler and not args.use_checkpoint_opt_param_scheduler
    for flag in ("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler"):
        assert parse_args([flag, *MOCK]).use_checkpoint_opt_param_scheduler


def test_virtual_pipeline_size_and_the_interleaved_schedule_s_micro_batches(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # PP=2: one data-parallel rank
    args = parse_args(["--num-layers", "4", "--pipeline-model-parallel-size", "2",
                       "--num-layers-per-virtual-pipeline-stage", "1", "--micro-batch-size", "2",
                       "--global-batch-size", "8", *MOCK])
    assert args.virtual_pipeline_model_parallel_size == 2
    # Two layers per stage, two per virtual stage: one chunk, no interleaving (Megatron-LM).
    assert parse_args(["--num-layers", "4", "--pipeline-model-parallel-size", "2",
                       "--num-layers-per-virtual-pipeline-stage", "2", *MOCK]
                      ).virtual_pipeline_model_parallel_size is None
    with pytest.raises(ValueError, match=r"interleaved pipeline schedule needs a multiple of "
                                         r"pipeline_model_parallel_size \(2\) micro-batches per "
                                         r"step; .* is 3"):
        parse_args(["--num-layers", "4", "--pipeline-model-parallel-size", "2",
                    "--num-layers-per-virtual-pipeline-stage", "1", "--micro-batch-size", "2",
                    "--global-batch-size", "6", *MOCK])
    with pytest.raises(ValueError, match=r"num_layers \(3\) must be divisible by "
                                         r"pipeline_model_parallel_size \(2\)"):
        parse_args(["--num-layers", "3", "--pipeline-model-parallel-size", "2", *MOCK])
    with pytest.raises(ValueError, match=r"num_layers per pipeline stage \(3\) must be divisible "
                                         r"by num_layers_per_virtual_pipeline_stage \(2\)"):
        parse_args(["--num-layers", "6", "--pipeline-model-parallel-size", "2",
                    "--num-layers-per-virtual-pipeline-stage", "2", *MOCK])


def test_mea_pretrain_builds_the_run_config_once_and_passes_it_down(monkeypatch):
    from megatron_mea.apps.training import loop
    from megatron_mea.apps.training.setup import run_settings
    from megatron_mea.cli.pretrain import main
    from megatron_mea.model import gpt

    built, received = [], []

    def counting(*args, **kwargs):
        built.append(real(*args, **kwargs))
        return built[-1]

    real = gpt.transformer_config
    monkeypatch.setattr(gpt, "transformer_config", counting)
    monkeypatch.setattr(loop, "pretrain", lambda args, config: received.append((args, config)))
    assert main(MOCK) == 0
    (args, config), = received
    assert built == [config] and built[0] is config  # validation's config, not a second one
    assert run_settings(args, config).config is config
