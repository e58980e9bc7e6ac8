"""Fixtures of the checkpoint tests: tiny HF checkpoints per family and their imports, built once
per session (each conversion is a few hundred milliseconds; the tests share them)."""

import os

import pytest

from tests.checkpoint._hf_models import build_hf_model, save_hf_model


class Checkpoints:
    """Lazily built checkpoints under one session directory."""

    def __init__(self, root):
        self.root = root
        self.models = {}
        self.dirs = {}

    def hf(self, family):
        """(HF directory, HF model) of the tiny `family` model."""
        if family not in self.models:
            model = build_hf_model(family)
            self.models[family] = (save_hf_model(model, os.path.join(self.root, family, "hf")),
                                   model)
        return self.models[family]

    def imported(self, family, variant="standard", **options):
        """Megatron checkpoint directory of `family` imported as `variant`."""
        from megatron_mea.checkpoint.hf.importing import import_hf_checkpoint

        tag = "-".join([variant] + [f"{k}={v}" for k, v in sorted(options.items())])
        key = (family, tag)
        if key not in self.dirs:
            hf_dir, _ = self.hf(family)
            out = os.path.join(self.root, family, tag)
            import_hf_checkpoint(hf_dir, out, attention_variant=variant, **options)
            self.dirs[key] = out
        return self.dirs[key]


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory, single_rank):
    """Session cache of tiny HF checkpoints and their Megatron imports."""
    return Checkpoints(str(tmp_path_factory.mktemp("checkpoints")))
