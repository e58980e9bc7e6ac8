"""The report as it leaves the GPU machine: at most four files at the top of the output folder.

The device machine returns few files (eight at most, two folders deep), so the report folder is
packed: `summary.txt`, `acceptance.json` and `console.log` as they are, and everything else
(step logs, pytest's JUnit XML, the benchmarks' JSON, the training records) in one
`report.tar.gz`.
"""

import os
import shutil
import tarfile
from typing import List

from megatron_mea.runtime.files import publish

KEPT = ("summary.txt", "acceptance.json", "console.log")
ARCHIVE = "report.tar.gz"


def pack_report(report_dir: str, out: str) -> List[str]:
    """Copy the top files of `report_dir` into `out` and archive the rest beside them.

    Args:
        report_dir: the full report (written by the run).
        out: the folder handed back (created; files of the same names are replaced).

    Returns:
        The names of the files written to `out` (at most four).
    """
    os.makedirs(out, exist_ok=True)
    written = []
    for name in KEPT:
        source = os.path.join(report_dir, name)
        if os.path.exists(source):
            shutil.copyfile(source, os.path.join(out, name))
            written.append(name)
    rest = sorted(name for name in os.listdir(report_dir) if name not in KEPT)
    if rest:
        partial = os.path.join(out, ARCHIVE + ".partial")
        with tarfile.open(partial, "w:gz") as archive:
            for name in rest:
                archive.add(os.path.join(report_dir, name), arcname=name)
        publish(partial, os.path.join(out, ARCHIVE))
        written.append(ARCHIVE)
    return written
