"""The `dsocr` command line: one click group, subcommands registered from sibling modules.

Exit codes: 0 ok, 1 internal error, 2 input error (bad file list, image, option or checkpoint),
3 transient error (database or broker unavailable), 4 poisoned job / failed check.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from dsocr_workers import __version__

# Piped or redirected, output is read by scripts: never cut a line to a guessed terminal width.
PIPED_WIDTH = 10_000


def stdout_console(stderr: bool = False) -> Any:
    """A rich Console for the terminal, or, where the stream is a pipe or file, one that keeps lines whole."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else PIPED_WIDTH)

EXIT_CODES_HELP = (
    "Exit codes: 0 ok; 1 internal error; 2 input error (bad file list, image, option, checkpoint); "
    "3 transient error (database or broker unavailable); 4 a check failed or jobs were poisoned."
)


@click.group(help=f"Profile DeepSeek-OCR inference on one GPU or a rack of them.\n\n{EXIT_CODES_HELP}")
@click.version_option(__version__, prog_name="dsocr")
def main() -> None:
    pass


# Each module defines `register(group)`; they import heavy dependencies (torch, celery, sqlalchemy)
# inside their commands so that `dsocr --help` stays fast.
COMMAND_MODULES: tuple[str, ...] = ("commands_model", "commands_farm", "commands_report")


def _register() -> None:
    import importlib

    for name in COMMAND_MODULES:
        importlib.import_module(f"dsocr_workers.cli.{name}").register(main)


_register()
