"""Installing the carried wheels on a GPU machine with no network and perhaps no pip.

A wheel is a zip archive laid out as it is installed, so unpacking the one that fits this
interpreter into a private folder on `PYTHONPATH` installs it (console scripts aside: the
acceptance run starts every tool with `python -m`). This module imports only the standard
library: it runs before anything else is installed.
"""

import os
import platform
import shutil
import sys
import zipfile
from importlib import metadata
from typing import Dict, List, NamedTuple, Optional

# Always installed from the wheels (the versions the plugin was tested with); any other
# distribution only when it is missing, so the machine's own builds (numpy, pytest...) are kept.
ALWAYS_INSTALL = ("megatron-core", "megatron-mea")


class Wheel(NamedTuple):
    """The parts of a wheel's file name (PEP 427): `dist-version[-build]-py-abi-platform.whl`."""

    path: str
    name: str  # normalised: lower case, `-` for `_` and `.`
    version: str
    python: str
    abi: str
    platform: str


def normalise(name: str) -> str:
    """A distribution name as pip compares them: `Megatron_Core` -> `megatron-core`."""
    return name.lower().replace("_", "-").replace(".", "-")


def parse_wheel(path: str) -> Optional[Wheel]:
    """The tags of `path`'s file name, or None if it is not a wheel's."""
    filename = os.path.basename(path)
    if not filename.endswith(".whl"):
        return None
    parts = filename[:-4].split("-")
    if len(parts) not in (5, 6):
        return None
    return Wheel(path, normalise(parts[0]), parts[1], *parts[-3:])


def fits_this_python(wheel: Wheel) -> bool:
    """Whether this interpreter (CPython on Linux, or any pure-Python wheel) can use `wheel`."""
    major, minor = sys.version_info[:2]
    cpython = f"cp{major}{minor}"
    pythons = wheel.python.split(".")
    if not any(tag in (cpython, f"py{major}{minor}", f"py{major}") for tag in pythons):
        # abi3 wheels name the oldest CPython they support
        if not (wheel.abi == "abi3" and any(
                tag.startswith(f"cp{major}") and int(tag[3:] or 0) <= minor for tag in pythons)):
            return False
    if wheel.abi not in ("none", "abi3", cpython):
        return False
    if wheel.platform == "any":
        return True
    machine = platform.machine()
    return sys.platform.startswith("linux") and any(
        tag.endswith("_" + machine) and (tag.startswith("manylinux") or tag.startswith("linux"))
        for tag in wheel.platform.split("."))


def _installed(name: str) -> bool:
    try:
        metadata.version(name)
        return True
    except metadata.PackageNotFoundError:
        return False


def wheels_to_install(directory: str) -> List[Wheel]:
    """One wheel per distribution of `directory` that this interpreter should install: those of
    `ALWAYS_INSTALL`, and any other whose distribution is missing; of several that fit, the
    newest version (`directory` may hold one per Python version of a compiled package)."""
    best: Dict[str, Wheel] = {}
    for filename in sorted(os.listdir(directory)):
        wheel = parse_wheel(os.path.join(directory, filename))
        if wheel is None or not fits_this_python(wheel):
            continue
        if wheel.name not in ALWAYS_INSTALL and _installed(wheel.name):
            continue
        current = best.get(wheel.name)
        if current is None or _version_key(wheel.version) > _version_key(current.version):
            best[wheel.name] = wheel
    return [best[name] for name in sorted(best)]


def _version_key(version: str):
    return [int(part) if part.isdigit() else -1 for part in version.split(".")]


def unpack(wheel: Wheel, site: str) -> None:
    """Install `wheel` into `site` by unpacking it; `<dist>.data/purelib|platlib` land in `site`
    itself, as pip would put them; scripts and headers are left out."""
    with zipfile.ZipFile(wheel.path) as archive:
        for member in archive.infolist():
            target = member.filename
            head, _, rest = target.partition("/")
            if head.endswith(".data"):
                kind, _, rest = rest.partition("/")
                if kind not in ("purelib", "platlib") or not rest:
                    continue
                target = rest
            destination = os.path.realpath(os.path.join(site, target))
            if not destination.startswith(os.path.realpath(site) + os.sep):
                raise ValueError(f"{wheel.path}: member {member.filename!r} leaves the folder")
            if member.is_dir():
                os.makedirs(destination, exist_ok=True)
                continue
            os.makedirs(os.path.dirname(destination), exist_ok=True)
            with archive.open(member) as source, open(destination, "wb") as sink:
                shutil.copyfileobj(source, sink)
            mode = (member.external_attr >> 16) & 0o777
            if mode:
                os.chmod(destination, mode)


def install_wheels(directory: str, site: str) -> List[str]:
    """Unpack into `site` every wheel of `directory` that this interpreter needs.

    Args:
        directory: the carried wheels (`make gpu-wheels`).
        site: the folder to install into (put on `PYTHONPATH` after the checkout). A
            distribution installed there before is replaced.

    Returns:
        The installed wheels' file names.

    Raises:
        FileNotFoundError: if `directory` does not exist.
    """
    os.makedirs(site, exist_ok=True)
    installed = []
    for wheel in wheels_to_install(directory):
        for entry in os.listdir(site):  # an older unpacked release of the same distribution
            if entry.endswith(".dist-info") and normalise(entry.split("-")[0]) == wheel.name:
                shutil.rmtree(os.path.join(site, entry))
        unpack(wheel, site)
        installed.append(os.path.basename(wheel.path))
    return installed


def main(argv: Optional[List[str]] = None) -> int:
    """`python -m megatron_mea.apps.acceptance.install WHEELS SITE`: unpack, print one line."""
    wheels, site = argv if argv is not None else sys.argv[1:]
    names = install_wheels(wheels, site)
    print(f"[install] {len(names)} wheels from {wheels} into {site}: {' '.join(names) or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
