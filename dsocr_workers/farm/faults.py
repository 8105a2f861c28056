"""TEST-ONLY fault injection for the reliability suite (tests/reliability): make a chosen job kill its
worker child or hang, which no real input does on demand.

Inactive unless the environment variable DSOCR_TEST_FAULTS is set; production never sets it (the compose
file, deploy/ and the README do not mention it), and with it unset `inject` returns at once. The value is
`;`-separated `fault=pattern` pairs, the pattern a glob matched against the job's image name:

    DSOCR_TEST_FAULTS="crash=poison*.png;hang=hung*.png"

    crash  the child SIGKILLs itself once the job is claimed: a job that takes its worker down every time
           (a segfault in a native library, the OOM killer). Exercises reject_on_worker_lost and the cap.
    hang   the child sleeps forever with the soft-time-limit signal blocked: a call stuck in native code
           that never returns to Python. Only the hard time limit (SIGKILL by the parent) ends it.

Everything else about the job is real: the claim, the ledger, Celery, the model.
"""

from __future__ import annotations

import fnmatch
import os
import signal
import time

FAULTS_ENV = "DSOCR_TEST_FAULTS"
KINDS = ("crash", "hang")


def parse(spec: str) -> list[tuple[str, str]]:
    rules = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        kind, sep, pattern = part.partition("=")
        if not sep or kind not in KINDS or not pattern:
            raise ValueError(f"{FAULTS_ENV}: {part!r} is not one of {', '.join(k + '=GLOB' for k in KINDS)}")
        rules.append((kind, pattern))
    return rules


def inject(image: str) -> None:
    """Apply the first fault whose pattern matches `image`; nothing when DSOCR_TEST_FAULTS is unset."""
    spec = os.environ.get(FAULTS_ENV)
    if not spec:
        return
    for kind, pattern in parse(spec):
        if fnmatch.fnmatchcase(image, pattern):
            if kind == "crash":
                os.kill(os.getpid(), signal.SIGKILL)
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})  # billiard's soft limit signal
            while True:
                time.sleep(3600)
