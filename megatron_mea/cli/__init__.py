"""Command-line entry points (the only modules that print), one console script each.

Every tool is `megatron_mea.cli.<name>.main(argv=None) -> int`, installed as `mea-<name>` (see
`[project.scripts]` in pyproject.toml) and also runnable as `python -m megatron_mea.cli.<name>`.
"""

from megatron_mea.runtime.quiet import quiet_warnings

# Importing this package is the first thing every tool does, before any module that imports
# Megatron-Core: its import-time notices are filtered here or never (they fire once).
quiet_warnings()
