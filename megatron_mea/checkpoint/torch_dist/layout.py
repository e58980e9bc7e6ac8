"""The directory layout of torch_dist checkpoints: the one module that names its entries.

Megatron-LM's layout, which `mea-pretrain` and the converters write too::

    <root>/latest_checkpointed_iteration.txt   # the tracker: the newest complete checkpoint
    <root>/iter_0000100/                       # the checkpoint of iteration 100
    <root>/rewound_from_iter_0000300/          # the checkpoints of a run abandoned by a rewind

Readers ask it which iterations are saved, which is the latest, where one lives and what is
missing; `mea-pretrain`'s run-directory rules (`megatron_mea.apps.training.run_dir`) ask it one
question each (`nothing_to_load`, `held_checkpoint`, `later_checkpoints` / `rewind`).
"""

import os
import re
from typing import List, Optional, Tuple

from megatron_mea.checkpoint.errors import CheckpointError
from megatron_mea.runtime.files import atomic_write

TRACKER = "latest_checkpointed_iteration.txt"
ITER_DIR = re.compile(r"^iter_(\d{7})$")
REWOUND = "rewound_from_"


def directory_name(iteration: int) -> str:
    """`iter_XXXXXXX`: the name of the checkpoint directory of `iteration`."""
    return f"iter_{iteration:07d}"


def checkpoint_dir(root: str, iteration: int) -> str:
    """Directory of the checkpoint of `iteration` under `root`."""
    return os.path.join(root, directory_name(iteration))


def saved_iterations(root: str) -> List[int]:
    """The iterations of the `iter_XXXXXXX` directories under `root`, ascending."""
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for m in map(ITER_DIR.match, os.listdir(root)) if m)


def latest_iteration(root: str) -> Optional[int]:
    """The iteration named by the tracker file, or None if there is no complete checkpoint.

    Raises:
        CheckpointError: the tracker holds something else than an iteration number.
    """
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        return None
    with open(path, "rb") as handle:
        raw = handle.read(64)
    text = raw.decode("ascii", "replace").strip()
    if not (text.isascii() and text.isdigit()):
        raise CheckpointError(f"{path}: expected an iteration number, found {raw[:20]!r}")
    return int(text)


def write_tracker(root: str, iteration: int) -> None:
    """Point the tracker of `root` at `iteration` (atomically: a crash leaves the old one)."""
    with atomic_write(os.path.join(root, TRACKER)) as handle:
        handle.write(str(iteration))


def split_checkpoint_path(path: str, iteration: Optional[int] = None
                          ) -> Tuple[str, Optional[int]]:
    """(run directory, iteration) of a `--load` that names a run directory or one of its
    `iter_XXXXXXX` folders, so every tool accepts both (`--load DIR --ckpt-step N` is
    `--load DIR/iter_000000N`).

    Raises:
        CheckpointError: `iteration` contradicts the folder's number.
    """
    path = os.path.normpath(path)
    match = ITER_DIR.match(os.path.basename(path))
    if not match:
        return path, iteration
    found = int(match.group(1))
    if iteration is not None and iteration != found:
        raise CheckpointError(f"--ckpt-step {iteration} contradicts the checkpoint path {path}")
    return os.path.dirname(path), found


def missing_checkpoint(directory: str) -> str:
    """The one line for an `iter_XXXXXXX` directory that does not exist: that its run directory
    does not exist either, or which iterations are saved there."""
    root = os.path.dirname(directory)
    if not os.path.isdir(root):
        return f"{root}: no such directory"
    found = saved_iterations(root)
    saved = ", ".join(map(str, found)) if found else "none"
    return f"{directory}: no such checkpoint (iterations saved there: {saved})"


def nothing_to_load(root: str) -> Optional[str]:
    """Why `root` has no checkpoint to load (None where its tracker names one): no such
    directory, or no tracker (naming the newest `iter_XXXXXXX` there and how to load it)."""
    if latest_iteration(root) is not None:
        return None
    if not os.path.isdir(root):
        return "no such directory"
    found = saved_iterations(root)
    return f"no {TRACKER}" + (
        f" ({directory_name(found[-1])} is there: pass --ckpt-step {found[-1]} to load it)"
        if found else ""
    )


def held_checkpoint(root: str) -> Optional[str]:
    """What shows that `root` holds checkpoints: its newest `iter_XXXXXXX`, else its tracker
    file (None: it holds none)."""
    found = saved_iterations(root)
    if found:
        return directory_name(found[-1])
    return TRACKER if os.path.exists(os.path.join(root, TRACKER)) else None


def later_checkpoints(root: str, iteration: int) -> List[str]:
    """The `iter_XXXXXXX` directories of `root` after `iteration`, which a run resumed at
    `iteration` abandons ([] where `iteration` is not saved there: the load names that)."""
    found = saved_iterations(root)
    if iteration not in found:
        return []
    return [directory_name(i) for i in found if i > iteration]


def rewind(root: str, iteration: int) -> str:
    """Move the `later_checkpoints` of `root` into `root/rewound_from_iter_M[.n]/` (M the
    newest) and point the tracker at `iteration`, so that `root` holds one run; returns the
    directory they moved to."""
    later = later_checkpoints(root, iteration)
    aside = os.path.join(root, REWOUND + later[-1])
    number, base = 0, aside
    while os.path.exists(aside):
        number += 1
        aside = f"{base}.{number}"
    os.makedirs(aside)
    for name in later:
        os.rename(os.path.join(root, name), os.path.join(aside, name))
    write_tracker(root, iteration)
    return aside
