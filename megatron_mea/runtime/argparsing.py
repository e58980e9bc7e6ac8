"""The command-line parser of every tool: argparse's, with a refusal in one line.

argparse prints the whole usage before its error: 95 lines for `mea-pretrain`, 578 for
`mea-model-size` (whose parser holds every Megatron-LM flag), and the line that matters scrolls
away. Here a bad flag or value is `mea-<tool>: error: <message>`, exit status 2, as every other
refusal of the tools; `--help` still prints the usage.
"""

import argparse


class ArgumentParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` whose errors are one line on stderr, exit status 2.

    Sub-command parsers (`add_subparsers`) are of this class too; their errors name the tool,
    not `tool sub-command`.
    """

    def error(self, message: str):
        """Print `<tool>: error: <message>` and exit with status 2 (no usage)."""
        self.exit(2, f"{self.prog.split()[0]}: error: {message}\n")
