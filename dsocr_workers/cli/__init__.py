"""The `dsocr` command line: one click group, subcommands registered from sibling modules.

Exit codes: 0 ok, 1 internal error, 2 input error (bad file list, image, option or checkpoint),
3 transient error (database or broker unavailable), 4 poisoned job / failed check.
"""

from __future__ import annotations

import click

from dsocr_workers import __version__

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
