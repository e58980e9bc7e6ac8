"""``python -m megatron_mea.cpu SCRIPT [ARGS...]``: Megatron-LM's scripts on a CPU-only torch
(`megatron_mea.cpu.runner`)."""

from megatron_mea.cpu.runner import main

if __name__ == "__main__":
    main()
