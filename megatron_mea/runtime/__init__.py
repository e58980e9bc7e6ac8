"""Plumbing every part uses: files written atomically and checked (`files`), process groups and
free ports (`process_groups`), the tools' one-line argument errors (`argparsing`), their warning
filters (`quiet`) and what their console shows of logging (`console`)."""
