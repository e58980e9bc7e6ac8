"""Deterministic, resumable micro-batches of a map-style dataset for one data-parallel rank."""

import torch


class MicroBatches:
    """Iterate micro-batches in the order Megatron-LM's pretraining sampler uses.

    Samples are consumed in global order; each step of `micro_batch_size * dp_size` samples gives
    rank r the slice `[r*mbs, (r+1)*mbs)`. `consumed_samples` (global) is all that is needed to
    resume exactly where a run stopped. Ranks of one TP/PP group share a dp rank, so they read the
    same samples.

    Args:
        dataset: map-style, items are dicts of tensors (`tokens`, `labels`, `loss_mask`,
            `position_ids`), e.g. Megatron's `GPTDataset`.
        micro_batch_size: samples per micro-batch on this rank.
        dp_rank, dp_size: this rank's position in the data-parallel group.
        consumed_samples: global samples already used (from a checkpoint).
        before_read: called before each micro-batch is read (e.g. `DataWatch.check`, which
            raises if the files changed under the run). Default: None.
    """

    def __init__(self, dataset, micro_batch_size, dp_rank, dp_size, consumed_samples=0,
                 before_read=None):
        self.dataset = dataset
        self.before_read = before_read
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.consumed_samples = consumed_samples

    def __iter__(self):
        return self

    def __next__(self):
        if self.before_read is not None:
            self.before_read()
        start = self.consumed_samples + self.dp_rank * self.micro_batch_size
        items = [
            self.dataset[(start + i) % len(self.dataset)] for i in range(self.micro_batch_size)
        ]
        self.consumed_samples += self.micro_batch_size * self.dp_size
        return {
            key: torch.stack([torch.as_tensor(item[key]) for item in items])
            for key in ("tokens", "labels", "loss_mask", "position_ids")
        }
