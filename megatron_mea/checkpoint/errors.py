"""The errors of the checkpoint formats (torch_dist, Megatron-LM, Hugging Face).

Every message is one line naming the file, the tensor or the setting. They sit beside the
formats, not inside one, because every format raises them (`megatron_lm` sits below
`torch_dist` and must not import it).
"""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked: the message names the file or tensor."""


class ModelMismatchError(CheckpointError):
    """The checkpoint's model tensors are not this model's (other names or shapes)."""


class ConversionError(ValueError):
    """A checkpoint or model that cannot be converted as asked; the message names the tensor."""
