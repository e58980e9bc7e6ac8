"""Per-rank bodies of the multi-process inference tests (module level, for spawned processes)."""

import os

from megatron_mea.inference import generate
from tests._models import (
    build_gpt,
    init_parallel,
    load_dist,
    perturb_plugin_params,
    save_dist,
    tiny_config,
)
from tests.inference._common import (
    NEW_TOKENS,
    PROMPTS,
    IdTokenizer,
    full_forward_logits,
)


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def tp_decoding(rank, world_size, variants, tp, workdir, prompts=PROMPTS):
    """For each variant: a TP=1 model (greedy, full-forward reference) and the same weights at
    TP=`tp` through a torch_dist checkpoint; their tokens, logit differences and cache bytes."""
    results = {}
    for name, fields in variants:
        init_parallel(tp=1)
        single = build_gpt(tiny_config(**fields))
        perturb_plugin_params(single)
        ref = generate(single, IdTokenizer(), prompts, NEW_TOKENS, stop_at_eod=False,
                       return_logits=True)
        save_dist(single, os.path.join(workdir, name))

        init_parallel(tp=tp)
        sharded = build_gpt(tiny_config(**fields, tp=tp))
        load_dist(sharded, os.path.join(workdir, name))
        out = generate(sharded, IdTokenizer(), prompts, NEW_TOKENS, stop_at_eod=False,
                       return_logits=True)
        full = full_forward_logits(sharded, prompts, out.tokens)
        results[name] = dict(
            same_tokens=out.tokens == ref.tokens,
            vs_full_forward=_max_diff(out.logits, full),
            vs_tp1=_max_diff(out.logits, ref.logits),
            bytes_tp1=ref.stats.kv_cache_bytes,
            bytes_rank=out.stats.kv_cache_bytes,
            bytes_total=out.stats.kv_cache_bytes_total,
        )
    return results


def pretrain(rank, world_size, argv):
    """A `mea-pretrain` run (saves config.yaml and torch_dist checkpoints under --save)."""
    from megatron_mea.apps.training.arguments import parse_run
    from megatron_mea.apps.training.loop import pretrain as run

    return [record["lm loss"] for record in run(*parse_run(argv))]


def generate_cli(rank, world_size, argv_list):
    """Run `mea-generate` once per argv (in this process); return what each printed."""
    import contextlib
    import io

    from megatron_mea.cli.generate import main

    outputs = []
    for argv in argv_list:
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            code = main(argv)
        outputs.append((code, buffer.getvalue()))
    return outputs


def generate_cli_warnings(rank, world_size, argv_list):
    """Run `mea-generate` once per argv (in this process); return its exit code and the
    warning lines it wrote to stderr."""
    import contextlib
    import io

    from megatron_mea.cli.generate import main

    outputs = []
    for argv in argv_list:
        errors = io.StringIO()
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            code = main(argv)
        outputs.append((code, [line for line in errors.getvalue().splitlines()
                               if "warning:" in line]))
    return outputs


def load_and_generate(rank, world_size, runs, prompts, new_tokens, vocab_size):
    """For each (checkpoint root, tp): `load_for_inference` at TP `tp`, greedy `generate`; the
    tokens, their logits over the real vocabulary, the model's logit rows and the largest
    logit of a padding row."""
    from megatron_mea.inference import load_for_inference

    results = []
    for root, tp in runs:
        loaded = load_for_inference(root, tp)
        out = generate(loaded.model, IdTokenizer(vocab_size), prompts, new_tokens,
                       stop_at_eod=False, return_logits=True)
        results.append(dict(
            tokens=out.tokens,
            logits=[logits[:, :vocab_size] for logits in out.logits],
            rows=out.logits[0].shape[-1],
            padding=max(logits[:, vocab_size:].abs().max().item() for logits in out.logits),
        ))
    return results
