"""The acceptance step that would run Megatron-LM's own `pretrain_gpt.py` (MEA and KHA, bf16)."""


def megatron_lm_runs(runner) -> dict:
    """Reports the step as not available on the GPU machine (it decides nothing).

    The checkout vendors the part of Megatron-LM that `pretrain_gpt.py` needs
    (`tests/integrations/megatron_lm_targets/`), and CI trains it on CPU through
    `python -m megatron_mea.cpu` (`tests/integrations/test_megatron_lm_cpu.py`). On a GPU its
    start-up runs `make` to build Megatron's dataset helpers, and the megatron-core wheel carries
    the built helper but no Makefile; the runner's fix for that (L7 in
    `megatron_mea/cpu/runner.py`) applies only without CUDA, so the step is not wired here.
    """
    return {"ok": None, "not_available": "Megatron-LM's start-up would `make` the dataset "
                                          "helpers, which the megatron-core wheel cannot build "
                                          "(no Makefile); see acceptance/megatron_lm.py"}
