"""TEST-ONLY: `dsocr` with faults in chosen jobs, for scenarios that need a fault no real input produces on
demand. The package itself carries no fault hook and no switch for one: this entry point, which lives
only in the test tree, wraps `JobProcess.infer` (farm/job/process.py: the call that runs a claimed job) and
`LedgerThreads.complete` (farm/job/ledger_threads.py) and `ledger.claim_job` (store/ledger.py), then hands the rest of its arguments
to `dsocr`:

    python tests/reliability/faulty_dsocr.py --crash 'poison*.png' --hang 'hung*.png' worker --gpus cpu

    --crash GLOB  the process running a job whose image matches SIGKILLs itself once the job is claimed:
                  a job that takes its worker down every time (a segfault in a native library, the OOM
                  killer). Exercises reject_on_worker_lost and the attempt cap.
    --hang GLOB   it sleeps forever with the soft-time-limit signal blocked: a call stuck in native code
                  that never returns to Python. Only the hard time limit (SIGKILL by the parent) ends it.
    --hang-claim GLOB
                  the first claim of a job whose image matches (once per job id, across processes: a
                  marker file) never returns: a claim stuck in the ledger (a connection that hangs) until
                  the hard time limit kills the process, before anything is written for the job.
    --lose-result GLOB
                  on the job's first attempt, its result is never handed to the ledger thread
                  (farm/job/ledger_threads.py) and the process SIGKILLs itself a second later: the task has returned
                  and its message is acknowledged, its result not written. The ledger must bring it back.

A worker's prefork children are forked from the process that installed the wrappers, so they run them;
`dsocr run` runs them in its own process. Everything else about the job is real: the claim, the ledger,
Celery, the model.
"""

from __future__ import annotations

import argparse
import fnmatch
import functools
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsocr_workers.store.ledger import Claim
from dsocr_workers.store.models import Job

RunJob = Callable[..., Any]  # JobProcess.infer, unbound: (process, claiming, **options) -> Ran
ClaimJob = Callable[..., Any]  # ledger.claim_job: (session, *, job_id, owner, ...) -> Claim | Refusal
Complete = Callable[[Any, Claim, Any, Any], None]  # LedgerThreads.complete, unbound: (thread, claim, build_row, finished_at)


@dataclass(frozen=True)
class Faults:
    """Image-name globs whose jobs crash or hang their process (none: plain `dsocr`)."""

    crash: tuple[str, ...] = ()
    hang: tuple[str, ...] = ()
    lose_result: tuple[str, ...] = ()
    hang_claim: tuple[str, ...] = ()

    def dsocr_command(self) -> list[str]:
        """The command line that starts `dsocr` with these faults; `python -m dsocr_workers` without any."""
        if not (self.crash or self.hang or self.lose_result or self.hang_claim):
            return [sys.executable, "-m", "dsocr_workers"]
        flags = [*(("--crash", glob) for glob in self.crash), *(("--hang", glob) for glob in self.hang),
                 *(("--lose-result", glob) for glob in self.lose_result),
                 *(("--hang-claim", glob) for glob in self.hang_claim)]  # fmt: skip
        return [sys.executable, str(Path(__file__).resolve()), *(part for flag in flags for part in flag)]


NO_FAULTS = Faults()


def with_faults(infer: RunJob, faults: Faults) -> RunJob:
    """`infer`, but a job whose image matches a glob of `faults` crashes or hangs its process after its
    claim (the ledger shows it running under this process's lease) instead of running."""

    @functools.wraps(infer)
    def infer_with_faults(process: Any, claiming: Any, **options: Any) -> Any:
        process.ledger_threads.release()  # as a job that waits for its claim does (`Prefetcher.job_to_run`)
        claim = claiming.result()
        if any(fnmatch.fnmatchcase(claim.image, glob) for glob in faults.crash):
            # This job alone crashes: the previous job's result, let out above, is written first (a child
            # killed before that write is the lost-result scenario, tested on its own).
            process.ledger_threads.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        if any(fnmatch.fnmatchcase(claim.image, glob) for glob in faults.hang):
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})  # billiard's soft time limit signal
            while True:
                time.sleep(3600)
        return infer(process, claiming, **options)

    return infer_with_faults


def losing_results(complete: Complete, globs: tuple[str, ...]) -> Complete:
    """`complete`, but the first attempt of a job whose image matches a glob is dropped and its process
    killed a second later, once its task has returned."""

    @functools.wraps(complete)
    def complete_or_lose(thread: Any, claim: Claim, build_row: Any, finished_at: Any) -> None:
        if claim.attempt == 1 and any(fnmatch.fnmatchcase(claim.image, glob) for glob in globs):
            threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGKILL)).start()
            return
        complete(thread, claim, build_row, finished_at)

    return complete_or_lose


def hanging_claims(claim_job: ClaimJob, globs: tuple[str, ...]) -> ClaimJob:
    """`claim_job`, but the first claim of a job whose image matches a glob sleeps forever instead (on the
    claims thread: the soft time limit interrupts the task's thread, which then waits for the claim again)."""
    markers = Path(tempfile.gettempdir()) / "dsocr-hang-claim"
    markers.mkdir(exist_ok=True)

    @functools.wraps(claim_job)
    def claim_or_hang(session: Any, **kwargs: Any) -> Any:
        job = session.get(Job, kwargs["job_id"])
        if job is not None and any(fnmatch.fnmatchcase(job.image, glob) for glob in globs):
            try:
                os.close(os.open(markers / kwargs["job_id"], os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass  # this job's claim hung once already
            else:
                while True:
                    time.sleep(3600)
        return claim_job(session, **kwargs)

    return claim_or_hang


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="faulty_dsocr.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--crash", action="append", default=[], metavar="GLOB", help="jobs that kill their process")
    parser.add_argument("--hang", action="append", default=[], metavar="GLOB", help="jobs that hang their process")
    parser.add_argument("--lose-result", action="append", default=[], metavar="GLOB",
                        help="jobs whose first result is lost with their process after their task returned")
    parser.add_argument("--hang-claim", action="append", default=[], metavar="GLOB",
                        help="jobs whose first claim never returns")
    parser.add_argument("dsocr_args", nargs=argparse.REMAINDER, help="the `dsocr` command line")
    args = parser.parse_args(argv)

    from dsocr_workers.cli import main as dsocr
    from dsocr_workers.farm.job.ledger_threads import LedgerThreads
    from dsocr_workers.farm.job.process import JobProcess
    from dsocr_workers.store import ledger

    JobProcess.infer = with_faults(JobProcess.infer, Faults(tuple(args.crash), tuple(args.hang)))
    if args.lose_result:
        LedgerThreads.complete = losing_results(LedgerThreads.complete, tuple(args.lose_result))
    if args.hang_claim:
        ledger.claim_job = hanging_claims(ledger.claim_job, tuple(args.hang_claim))  # type: ignore[assignment]
    dsocr(args.dsocr_args, prog_name="dsocr")


if __name__ == "__main__":
    main(sys.argv[1:])
