"""Build the tiny native exports the vLLM tests serve, through the package's own conversion path.

Run with the main venv (megatron-core installed), before the tests in the vLLM venv:

    .venv/bin/python -m tests.vllm.make_exports OUT_DIR

For each case: a random tiny Hugging Face model of the family (the case's head dim: vLLM's CPU
attention takes head sizes 32-256) -> `import_hf_checkpoint` (MEA / KHA upcycling) or
`compress_checkpoint` (MEA with nc < ng components) -> the plugin's parameters moved away from
their identity init -> `export_hf_checkpoint` (native format; plain for the baselines).
`OUT_DIR/<case>/` is the export; one made from the same case is kept (the step is idempotent),
one made from another version of the case is made again.
"""

import argparse
import dataclasses
import json
import os
import shutil
import sys

from tests.vllm.cases import CASES


def hf_model(family, seed=0, head_dim=32, context=256):
    """A tiny random fp32 HF model of `family` sized for vLLM's CPU attention."""
    from tests.checkpoint._hf_models import build_hf_model

    sizes = dict(vocab_size=128, hidden_size=128, intermediate_size=192, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=head_dim, max_position_embeddings=context)
    if family == "qwen3_moe":
        sizes.update(moe_intermediate_size=96)
    if family == "mixtral":
        sizes.update(intermediate_size=96)
    return build_hf_model(family, seed=seed, **sizes)


def build_case(case, root):
    """Write the export of `case` (a `cases.Case`) under `root/case.name`."""
    from megatron_mea.checkpoint.hf.exporting import export_hf_checkpoint
    from megatron_mea.checkpoint.hf.importing import import_hf_checkpoint
    from megatron_mea.checkpoint.transforms.compress import compress_checkpoint
    from tests.checkpoint._hf_models import save_hf_model
    from tests.checkpoint._megatron import perturb_plugin_params

    out = os.path.join(root, case.name)
    stamp = os.path.join(root, "_work", f"{case.name}.case.json")
    made_from = json.dumps(dataclasses.asdict(case), sort_keys=True)
    if os.path.exists(os.path.join(out, "config.json")) and os.path.exists(stamp):
        with open(stamp, encoding="utf-8") as handle:
            if handle.read() == made_from:
                return out
    shutil.rmtree(out, ignore_errors=True)  # made from another version of the case
    work = os.path.join(root, "_work", case.name)
    shutil.rmtree(work, ignore_errors=True)  # what an interrupted run left
    model = hf_model(case.family, head_dim=case.head_dim, context=case.context)
    hf_dir = save_hf_model(model, os.path.join(work, "hf"))
    source = os.path.join(work, "megatron")
    if case.components is None:
        import_hf_checkpoint(hf_dir, source, attention_variant=case.variant, **case.options)
    else:  # MEA with nc < ng: post-hoc compression of the baseline (SVD of its K/V heads)
        baseline = os.path.join(work, "baseline")
        import_hf_checkpoint(hf_dir, baseline)
        compress_checkpoint(baseline, source, case.components, **case.options)
    if case.variant != "standard":
        source = perturb_plugin_params(source, os.path.join(work, "trained"))
    fmt = "plain" if case.variant == "standard" else "native"
    export_hf_checkpoint(source, out, format=fmt)
    with open(stamp, "w", encoding="utf-8") as handle:
        handle.write(made_from)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--cases", nargs="+", default=[c.name for c in CASES])
    args = parser.parse_args(argv)
    from megatron_mea.checkpoint.torch_dist.model_only import converter_process
    from megatron_mea.cpu import megatron_on_cpu
    from megatron_mea.runtime.quiet import quiet_warnings

    quiet_warnings()
    os.makedirs(args.out, exist_ok=True)
    # One gloo world of one process for every conversion (the rewrite of the plugin's
    # parameters needs Megatron's parallel state too).
    with megatron_on_cpu(), converter_process():
        for case in CASES:
            if case.name in args.cases:
                print(f"[make_exports] {build_case(case, args.out)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
