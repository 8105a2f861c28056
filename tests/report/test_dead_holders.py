"""A job whose worker died holding it: the report names that worker process (marked DEAD) beside the one
that finished the job, counts the attempt it lost, and says in its main tables that the job was tried
again. Written through the ledger's own claim (a dead holder's expired lease, then the takeover by
`execute_job`) on SQLite and PostgreSQL."""

from __future__ import annotations

import json
from datetime import timedelta

from click.testing import CliRunner
from fakes import WORKER, Page, add_session, fake_result

from dsocr_workers.cli import main
from dsocr_workers.farm.filelist import read_filelist
from dsocr_workers.farm.job.execute import Ran, execute_job
from dsocr_workers.farm.run_options import RunOptions
from dsocr_workers.farm.submit import record_run
from dsocr_workers.settings import Settings
from dsocr_workers.store import ledger
from dsocr_workers.store.models import Worker, WorkerProcess, utcnow
from dsocr_workers.store.upsert import upsert

DEAD = "node-7:4242:dead0001"  # a lease owner name (host:pid:nonce)


def test_report_lists_a_dead_holder_and_the_retry(database, tmp_path, make_png):
    for name in ("a.png", "b.png"):
        make_png(name, folder=tmp_path)
    (tmp_path / "list.txt").write_text("a.png\nb.png\n")
    run = record_run(database, read_filelist(tmp_path / "list.txt"), RunOptions(mode="tiny"), queue="q")
    now = utcnow()
    add_session(database, "s-live", now - timedelta(seconds=30), now - timedelta(seconds=20))
    with database.transaction() as session:
        upsert(session, Worker, WORKER, ["id"])
        # The dead one beat last two minutes ago and never stopped; it claimed the first job.
        session.add(WorkerProcess(id=DEAD, host="node-7", pid=4242, device="cuda:1", queues="q",
                                  started_at=now - timedelta(minutes=5), heartbeat_at=now - timedelta(minutes=2)))  # fmt: skip
        claim = ledger.claim_job(session, run.job_ids[0], DEAD, lease_s=-1, max_attempts=3,
                                 is_dead=lambda owner: False, now=now - timedelta(minutes=2))  # fmt: skip
        assert isinstance(claim, ledger.Claim)

    def infer(claiming):
        claiming.result()
        return Ran(fake_result(Page(1.0, session="s-live")), WORKER["id"], "s-live")

    for job_id in run.job_ids:  # the live worker takes the first job over (its lease ran out), then the second
        assert execute_job(database, job_id, owner="gpu-host:1:live", settings=Settings(), infer=infer).status == "done"

    result = CliRunner().invoke(main, ["report", "--run", run.run_id, "--format", "json"],
                                env={"DSOCR_DATABASE_URL": database.url})  # fmt: skip
    assert result.exit_code == 0, result.output
    tables = json.loads(result.stdout)["tables"]
    facts = {row["field"]: row["value"] for row in tables["Run"]}
    assert (facts["jobs"], facts["ok"], facts["attempts"], facts["jobs retried (attempts > 1)"]) == (2, 2, 3, 1)
    processes = {(row["host"], row["pid"]): row for row in tables["Worker processes"]}
    dead = processes[("node-7", 4242)]
    assert dead["process"].startswith("DEAD (last beat ") and dead["attempts lost"] == 1 and dead["jobs"] == 0
    assert dead["device"] == "cuda:1"
    (live,) = [row for key, row in processes.items() if key != ("node-7", 4242)]
    assert live["jobs"] == 2 and live["attempts lost"] == 0
