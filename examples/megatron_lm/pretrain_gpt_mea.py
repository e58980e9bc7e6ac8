"""Megatron-LM's `pretrain_gpt.py` with the megatron_mea flags, config class and specs.

Run it like `pretrain_gpt.py`, with the root of a Megatron-LM checkout on PYTHONPATH
(`pretrain_gpt`, `gpt_builders` and `model_provider` are imported from there) and megatron_mea
installed. The checkout's tag goes with the installed megatron-core: `core_v0.16.1` with 0.16.x,
`core_v0.19.0` with 0.19.x:

    PYTHONPATH=$MEGATRON_LM_DIR torchrun ... examples/megatron_lm/pretrain_gpt_mea.py \
        <Megatron-LM flags> --attention-variant mea

Everything except the model builder and the extra flags (datasets, forward step, embedding ranks,
in-process restart) is reused from Megatron-LM's `pretrain_gpt` module. At `core_v0.19.0`,
`pretrain()` takes a config container first and builds the model from its `model` config; this
script leaves that empty and passes the model provider, which `pretrain()` still accepts (as
`pretrain_vlm.py` does there), so both tags build the model through `mea_gpt_builder`.

With `--mea-tp-exchange weights` (or `auto`) this script also turns on the per-step fold cache:
the MEA layers fold their K/V weights once per optimizer step instead of once per micro-batch.
The cache needs its gradients flushed before Megatron reduces them, so Megatron-LM's
`finalize_model_grads` (which `train()` installs by its module-level name) is wrapped here. Other
entry points (the `patches/` series) fold once per micro-batch, which needs no flush.
"""

import inspect
import time

_PROGRAM_START_TIME = time.time()

import pretrain_gpt  # noqa: E402  (Megatron-LM checkout root; its __main__ block is guarded)
from megatron.core.enums import ModelType  # noqa: E402
from megatron.training import inprocess_restart, pretrain, set_startup_timestamps  # noqa: E402
from megatron.training import training as megatron_training  # noqa: E402
from model_provider import model_provider  # noqa: E402

from megatron_mea.integrations.megatron_lm import add_mea_args, mea_gpt_builder  # noqa: E402
from megatron_mea.layers import enable_fold_cache, with_fold_flush  # noqa: E402


def mea_model_provider(*args, **kwargs):
    """Megatron-LM's `model_provider` with the plugin's builder; MEA layers that fold their
    weights get the per-step fold cache (flushed by the wrapped `finalize_model_grads`)."""
    model = model_provider(mea_gpt_builder, *args, **kwargs)
    enable_fold_cache(model)
    return model


def extra_args_provider(parser):
    """The plugin flags, plus ModelOpt's when `pretrain_gpt.py` would add them."""
    # A tree patched with patches/ already has the flags; adding them twice is an argparse error.
    if "--attention-variant" not in parser._option_string_actions:
        parser = add_mea_args(parser)
    if pretrain_gpt.has_nvidia_modelopt:
        parser = pretrain_gpt.add_modelopt_args(parser)
    return parser


ARGS_DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}


def run_pretrain(run, store) -> None:
    """Call Megatron-LM's (possibly restart-wrapped) `pretrain` with this script's provider.

    Args:
        run: `pretrain`, or its in-process-restart wrapper.
        store: the restart wrapper's store (None without in-process restart).
    """
    common = dict(store=store, get_embedding_ranks=pretrain_gpt.get_embedding_ranks)
    if "cfg_container" not in inspect.signature(pretrain).parameters:
        # core_v0.16.1: pretrain() parses the arguments itself.
        run(
            pretrain_gpt.train_valid_test_datasets_provider,
            mea_model_provider,
            ModelType.encoder_or_decoder,
            pretrain_gpt.forward_step,
            args_defaults=ARGS_DEFAULTS,
            extra_args_provider=extra_args_provider,
            **common,
        )
        return
    # core_v0.19.0: the entry script parses, and passes the config container. No model config in
    # it, so pretrain() builds the model with the provider.
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    args = parse_and_validate_args(extra_args_provider=extra_args_provider,
                                   args_defaults=ARGS_DEFAULTS)
    run(
        pretrain_cfg_container_from_args(args),
        pretrain_gpt.train_valid_test_datasets_provider,
        ModelType.encoder_or_decoder,
        pretrain_gpt.forward_step,
        mea_model_provider,
        **common,
    )


if __name__ == "__main__":
    set_startup_timestamps(program_start=_PROGRAM_START_TIME, main_entry=time.time())
    pretrain_gpt.train_valid_test_datasets_provider.is_distributed = True
    # train() sets config.finalize_model_grads_func = finalize_model_grads (by its module-level
    # name, at both tags); flush the fold caches first, before the gradient reduction.
    megatron_training.finalize_model_grads = with_fold_flush(megatron_training.finalize_model_grads)
    run_pretrain(*inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain))
