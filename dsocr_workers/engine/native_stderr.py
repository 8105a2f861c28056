"""Named lines that torch's C++ code prints on the process's stderr, dropped around the one call known to
print them.

torch's C++ logger (c10 `LOG(WARNING)`) writes to file descriptor 2, past Python's `warnings` and
`logging`; its one switch, `TORCH_CPP_LOG_LEVEL`, is read once when torch is imported and silences every
C++ warning of the process. `Dropping` silences lines by their text instead: while the call runs, fd 2
goes to a file, and whatever else was written there meanwhile is written back to stderr afterwards.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

_LOCK = threading.Lock()  # fd 2 is the process's: one redirection at a time


class Dropping:
    """Drops the stderr lines holding any of `texts` written while `around()` runs; keeps the rest."""

    def __init__(self, *texts: str) -> None:
        self.texts = [text.encode() for text in texts]
        self._sink: IO[bytes] | None = None

    @contextmanager
    def around(self) -> Iterator[None]:
        with _LOCK:
            saved = self._redirect()
            try:
                yield
            finally:
                if saved is not None:
                    self._restore(saved)

    def close(self) -> None:
        if self._sink is not None:
            self._sink.close()
            self._sink = None

    def _redirect(self) -> int | None:
        """fd 2 to the sink; the descriptor it was (None: no stderr to filter)."""
        try:
            sys.stderr.flush()  # Python's own pending text goes out before fd 2 moves
            saved = os.dup(2)
        except (OSError, ValueError, AttributeError):
            return None
        if self._sink is None:
            self._sink = tempfile.TemporaryFile()  # noqa: SIM115 (kept for every call; close() closes it)
        os.dup2(self._sink.fileno(), 2)
        return saved

    def _restore(self, saved: int) -> None:
        assert self._sink is not None
        os.dup2(saved, 2)
        os.close(saved)
        self._sink.seek(0)
        written = self._sink.read()
        self._sink.seek(0)
        self._sink.truncate()
        kept = b"".join(line for line in written.splitlines(keepends=True) if not self._dropped(line))
        while kept:
            kept = kept[os.write(2, kept) :]

    def _dropped(self, line: bytes) -> bool:
        return any(text in line for text in self.texts)
