"""Pickle-based checkpoint files read without running code from them.

torch's dist-checkpoint reader unpickles a checkpoint's `.metadata` index with plain `pickle`,
and its load planner reads the byte objects stored in the shards (Megatron's RNG state, from
Megatron-Core 0.17 the common state) with `torch.load(weights_only=False)`: a crafted file runs
any code it names. Here every such file is read first by an unpickler that admits only the
globals those formats need (`ALLOWED`): torch.distributed.checkpoint's metadata classes, torch's
tensor rebuilding, dtypes and sizes, numpy arrays (NumPy's RNG state), and builtin containers. A
file naming anything else is refused before torch touches it (`UnsafePickleError`).

`check_pickle` and `check_torch_save` only scan: each admitted global is replaced by an inert
stand-in, so nothing from the file runs, not even the admitted constructors. `load_pickle`
returns the real objects, built from admitted globals only.
"""

import io
import pickle
import zipfile
from typing import BinaryIO, FrozenSet, Tuple, Union

from megatron_mea.checkpoint.megatron_lm.saved_types import (
    MEGATRON_LM_ARGUMENT_CLASSES,
    MEGATRON_LM_ARGUMENT_CONTAINERS,
)

__all__ = ["ALLOWED", "UnsafePickleError", "check_pickle", "check_torch_save", "load_pickle"]


class UnsafePickleError(ValueError):
    """A pickle that names a global outside the allow-list (or is not a pickle at all)."""


_DCP = "torch.distributed.checkpoint"
_NUMPY_CORE = ("numpy.core.multiarray", "numpy._core.multiarray")

# (module, name) pairs the checkpoint formats of torch DCP, Megatron-Core and this package use.
ALLOWED: FrozenSet[Tuple[str, str]] = frozenset(
    [
        # torch.distributed.checkpoint's index (.metadata)
        (f"{_DCP}.metadata", name) for name in (
            "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
            "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
        )
    ] + [
        # Megatron-Core keeps the save plans in the index
        (f"{_DCP}.planner", name) for name in (
            "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "LoadPlan", "ReadItem",
            "LoadItemType",
        )
    ] + [
        (f"{_DCP}.filesystem", "_StorageInfo"),
        (f"{_DCP}._extension", "ExtensionRegistry"),
        ("pathlib", "PosixPath"),  # the checkpoint_id of torch's StorageMeta
        ("pathlib", "PurePosixPath"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a layout by its name (a table lookup)
        ("torch", "device"),
        ("torch", "strided"),
        ("torch", "contiguous_format"),
        ("torch", "channels_last"),
        ("torch", "preserve_format"),
        # dtypes pickle as torch.<name>
        *[("torch", name) for name in (
            "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8",
            "uint8", "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2",
        )],
        # tensors and storages saved by torch.save
        ("torch._utils", "_rebuild_tensor_v2"),
        ("torch._utils", "_rebuild_parameter"),
        ("torch.storage", "UntypedStorage"),
        *[("torch", f"{kind}Storage") for kind in (
            "Float", "Double", "Half", "BFloat16", "Long", "Int", "Short", "Char", "Byte", "Bool",
        )],
        # containers and the bytes encoding of protocol 2
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "slice"),
        ("_codecs", "encode"),
        # Megatron-LM's common state also holds its argparse arguments (pickle names a class by
        # its __module__: `_io` for BytesIO)
        *[(cls.__module__, cls.__qualname__) for cls in MEGATRON_LM_ARGUMENT_CONTAINERS],
        *[tuple(qualified.rsplit(".", 1)) for qualified in MEGATRON_LM_ARGUMENT_CLASSES],
        # NumPy arrays (numpy.random.get_state in the RNG state)
        *[(module, "_reconstruct") for module in _NUMPY_CORE],
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        *[("numpy.dtypes", f"{kind}DType") for kind in (
            "UInt32", "Int64", "Float64", "Float32", "Int32", "UInt8", "Bool",
        )],
    ]
)


class _Inert:
    """Stand-in for an admitted global while scanning: accepts any construction and state."""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Inert()

    def __setstate__(self, state):
        pass

    def append(self, item):
        pass

    def extend(self, items):
        pass

    def __setitem__(self, key, value):
        pass


class _Restricted(pickle.Unpickler):
    def __init__(self, handle: BinaryIO, where: str, scan: bool, allowed):
        super().__init__(handle)
        self.where, self.scan, self.allowed = where, scan, allowed

    def find_class(self, module, name):
        if (module, name) not in self.allowed:
            raise UnsafePickleError(
                f"{self.where}: refused: it names {module}.{name}, which checkpoint files do not "
                "contain (a crafted or foreign file; nothing in it was run)"
            )
        if self.scan:
            return type(name, (_Inert,), {})
        return super().find_class(module, name)

    def persistent_load(self, pid):  # torch.save's storages: data lives outside the pickle
        return _Inert()


def _run(data: Union[bytes, BinaryIO], where: str, scan: bool, allowed):
    handle = io.BytesIO(data) if isinstance(data, (bytes, bytearray, memoryview)) else data
    try:
        return _Restricted(handle, where, scan, allowed).load()
    except UnsafePickleError:
        raise
    except Exception as exc:  # noqa: B902 -- any parse failure: not a readable pickle
        raise UnsafePickleError(f"{where}: not a readable pickle ({type(exc).__name__}: {exc})")


def check_pickle(data: Union[bytes, BinaryIO], where: str, allowed=ALLOWED) -> None:
    """Scan a pickle (e.g. a `.metadata` index) without running anything from it.

    Raises:
        UnsafePickleError: naming `where` and the first global outside `allowed`.
    """
    _run(data, where, True, allowed)


def load_pickle(data: Union[bytes, BinaryIO], where: str, allowed=ALLOWED):
    """Unpickle, building objects from the globals of `allowed` only (UnsafePickleError
    otherwise)."""
    return _run(data, where, False, allowed)


def check_torch_save(data: Union[bytes, str], where: str, allowed=ALLOWED) -> None:
    """Scan a `torch.save` file (a path) or its bytes: every pickle in the archive.

    Raises:
        UnsafePickleError: not a torch zip archive, or a pickle naming a global outside
            `allowed`.
    """
    source = io.BytesIO(data) if isinstance(data, (bytes, bytearray, memoryview)) else data
    try:
        archive = zipfile.ZipFile(source)
    except (zipfile.BadZipFile, OSError) as exc:
        raise UnsafePickleError(f"{where}: not a torch.save archive ({exc})") from None
    with archive:
        pickles = [name for name in archive.namelist() if name.endswith(".pkl")]
        if not pickles:
            raise UnsafePickleError(f"{where}: not a torch.save archive (no pickle in it)")
        for name in pickles:
            with archive.open(name) as member:
                check_pickle(member.read(), where, allowed)
