"""Fixed token samples read from a Megatron `.bin/.idx` dataset, for measurements on a
checkpoint (e.g. `mea-convert probe`'s losses, which take the tokens and read no file)."""

import torch


def load_tokens(data_prefix: str, seq_length: int, num_samples: int) -> torch.Tensor:
    """`[num_samples, seq_length + 1]` token ids from a Megatron `.bin/.idx` dataset (documents
    concatenated in order)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(data_prefix)
    needed = num_samples * (seq_length + 1)
    pieces, count = [], 0
    for index in range(len(dataset)):
        document = torch.as_tensor(dataset[index].astype("int64"))
        pieces.append(document)
        count += document.numel()
        if count >= needed:
            break
    if count < needed:
        raise ValueError(
            f"{data_prefix}: {count} tokens, the probe needs {needed} "
            f"({num_samples} x {seq_length + 1}); lower --num-samples or --seq-length"
        )
    return torch.cat(pieces)[:needed].view(num_samples, seq_length + 1)
