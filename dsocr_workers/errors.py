"""The project's exceptions.

    DsocrError                 base class; exit code 1 (internal)
    ├── InputError             bad input (image, file list, checkpoint); final, never retried; exit 2
    │   └── CheckpointError    a checkpoint directory that does not match the architecture
    ├── TransientError         the database or broker is down; retried with backoff; exit 3
    └── FailuresError          the command ran to its end and some of its work failed; exit 4

The farm classifies failures with these classes: an `InputError` fails a job after one attempt, a
`TransientError` is retried, anything else counts as an attempt and poisons the job at the cap.
"""

from __future__ import annotations


class DsocrError(Exception):
    """Base class of every error the project raises on purpose."""

    exit_code = 1


class InputError(DsocrError):
    """The input is wrong (missing or unreadable image, bad file list, bad option); never retried."""

    exit_code = 2


class CheckpointError(InputError):
    """A checkpoint directory whose config, files or tensors match no model family's architecture."""


class TransientError(DsocrError):
    """A dependency (database, broker) is unavailable for now; the operation may succeed later."""

    exit_code = 3


class FailuresError(DsocrError):
    """The command did its work and some of it failed: jobs of `dsocr run` failed or were poisoned,
    checks of `dsocr verify` failed. Its output (the report, the checks) is printed before it is raised."""

    exit_code = 4
