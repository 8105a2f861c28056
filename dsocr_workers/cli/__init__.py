"""The `dsocr` command line: one click group, subcommands registered from sibling modules.

Every command maps the project's errors to one line on stderr and the error class's exit code
(`exits_on_errors`, errors.py): 0 ok, 1 internal error, 2 input error, 3 transient error, 4 failures.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from dsocr_workers import __version__, settings
from dsocr_workers.engine.coldstart.cache import use_bytecode_cache, use_compile_cache
from dsocr_workers.errors import DsocrError

F = TypeVar("F", bound=Callable[..., Any])

# Piped or redirected, output is read by scripts: never cut a line to a guessed terminal width.
PIPED_WIDTH = 10_000


def stdout_console(stderr: bool = False) -> Any:
    """A rich Console for the terminal, or, where the stream is a pipe or file, one that keeps lines whole."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else PIPED_WIDTH)

def settings_help(*variables: settings.Variable) -> str:
    """Where a command's settings come from, each variable with its meaning and default as the registry
    (settings.py) states them; click keeps the lines as they are (\\b)."""
    lines = [f"  {v.name} (default {v.shown_default.strip('`')}): {v.doc}" for v in variables]
    return "\b\nSettings from the environment (all of them: the README's Configuration):\n" + "\n".join(lines)


LEDGER_AND_BROKER_HELP = settings_help(settings.DATABASE_URL, settings.BROKER_URL)


def counted(n: int, noun: str) -> str:
    """`1 job`, `3 jobs`."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def terminal_width() -> int | None:
    """The terminal's width where stdout is one; None where it is piped or redirected (then a report's
    tables are as wide as their content, report/render.py)."""
    import shutil

    return shutil.get_terminal_size().columns if sys.stdout.isatty() else None


EXIT_CODES_HELP = (
    "Exit codes: 0 ok; 1 internal error; 2 input error (bad file list, image, option, setting, checkpoint); "
    "3 transient error (database or broker unavailable); 4 failures (jobs of `run` failed or were "
    "poisoned, checks of `verify` failed)."
)


def exits_on_errors(command: F) -> F:
    """Our errors become a one-line message on stderr and their exit code (2 input, 3 transient, …)."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except DsocrError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)

    return wrapper  # type: ignore[return-value]


# The commands that load a model (and may compile): the ones the compile cache is for.
OPENS_A_MODEL = ("worker", "run", "infer", "verify", "precompile")


@click.group(help=f"Profile DeepSeek-OCR inference on one GPU or a rack of them.\n\n{LEDGER_AND_BROKER_HELP}\n\n"
                 f"{EXIT_CODES_HELP}")
@click.version_option(__version__, prog_name="dsocr")
@click.pass_context
def main(context: click.Context) -> None:
    # Before any command imports torch: a worker's start without bytecode compiles every source again.
    use_bytecode_cache()
    if context.invoked_subcommand in OPENS_A_MODEL:
        # Where what torch compiles persists, for this process and the ones it starts
        # (engine/coldstart/cache.py).
        use_compile_cache()


# Each module defines `register(group)`; they import heavy dependencies (torch, celery, sqlalchemy)
# inside their commands so that `dsocr --help` stays fast.
COMMAND_MODULES: tuple[str, ...] = ("commands_model", "commands_farm", "commands_build", "commands_report")


def _register() -> None:
    import importlib

    for name in COMMAND_MODULES:
        importlib.import_module(f"dsocr_workers.cli.{name}").register(main)


_register()
