"""The migrations build exactly the schema the models describe, on SQLite and PostgreSQL, and the newest
one goes down and up again without loss of the older columns."""

from __future__ import annotations

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, select, text

from dsocr_workers.farm.filelist import read_filelist
from dsocr_workers.farm.run_options import RunOptions
from dsocr_workers.farm.submit import record_run
from dsocr_workers.store.db import alembic_config, current_revision, head_revision, open_database, upgrade
from dsocr_workers.store.models import Base, Profile


def test_migrated_schema_matches_the_models(database):
    with database.engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        assert compare_metadata(context, Base.metadata) == []


def test_newest_revisions_go_down_and_up(tmp_path):
    db = open_database(f"sqlite:///{tmp_path / 'ledger.db'}")
    upgrade(db)
    config = alembic_config(db.url)
    with db.engine.begin() as connection:
        config.attributes["connection"] = connection
        command.downgrade(config, "0002")
    columns = {c["name"] for c in inspect(db.engine).get_columns("results")}
    assert current_revision(db) == "0002" and "text_edit" not in columns and "cold" in columns
    assert "prefetched" not in columns and "table_teds" not in columns and "matched_by" not in columns
    assert "reference" not in {c["name"] for c in inspect(db.engine).get_columns("jobs")}
    assert not {"worker_processes", "batch_steps"} & set(inspect(db.engine).get_table_names())
    assert upgrade(db) == head_revision() == current_revision(db)
    assert "batch_steps" in inspect(db.engine).get_table_names()
    assert [i["column_names"] for i in inspect(db.engine).get_indexes("batch_steps")] == [["run_id"]]
    assert "worker_process_id" in {c["name"] for c in inspect(db.engine).get_columns("worker_sessions")}
    columns = {c["name"] for c in inspect(db.engine).get_columns("results")}
    assert {"loop_start", "loop_period", "loop_wasted_steps", "text_edit", "reading_order_edit"} <= columns
    assert {"prefetched", "page_wait_ms", "ttft_from_claim_ms", "ttft_from_device_start_ms", "device_started_at",
            "device_finished_at", "table_teds", "table_teds_structure", "matched_by"} <= columns  # fmt: skip
    db.dispose()


def test_the_job_profiles_recorded_before_0016_are_kept_up_and_down(tmp_path, make_png):
    """0016 makes `job_profiles` the `profiles` of jobs and batch steps: a job's profile moves across,
    and back down again."""
    db = open_database(f"sqlite:///{tmp_path / 'ledger.db'}")
    upgrade(db)
    make_png("a.png", folder=tmp_path / "pages")
    (tmp_path / "pages" / "list.txt").write_text("a.png\n")
    run = record_run(
        db, read_filelist(tmp_path / "pages" / "list.txt"), RunOptions(profile_every=1), queue="q"
    )
    (job_id,) = run.job_ids
    summary = {"activity": "cpu", "stages": [], "decode_steps": [], "format": 1}
    with db.transaction() as tx:
        tx.add(Profile(run_id=run.run_id, job_id=job_id, activity="cpu", trace_gz=b"gz", trace_bytes=9,
                       summary=summary))  # fmt: skip
    config = alembic_config(db.url)
    with db.engine.begin() as connection:
        config.attributes["connection"] = connection
        command.downgrade(config, "0015")
    with db.engine.connect() as connection:
        kept = connection.execute(
            text("SELECT job_id, run_id, trace_gz, trace_bytes FROM job_profiles")
        ).all()
    assert kept == [(job_id, run.run_id, b"gz", 9)] and "profiles" not in inspect(db.engine).get_table_names()
    assert "profiled" not in {c["name"] for c in inspect(db.engine).get_columns("batch_steps")}
    upgrade(db)
    with db.transaction() as tx:
        (profile,) = tx.scalars(select(Profile)).all()
        assert (profile.job_id, profile.batch_step_id, profile.trace_gz, profile.summary) == (job_id, None, b"gz",
                                                                                                summary)  # fmt: skip
    assert "job_profiles" not in inspect(db.engine).get_table_names()


def test_a_family_stage_another_family_stored_as_0_becomes_null(sqlite_url, tmp_path, make_png):
    """0017: rows of one model family that stored 0 for another family's view encoder (CLIP in
    DeepSeek-OCR-2's, the Qwen2 encoder in DeepSeek-OCR's) hold NULL, the measured times kept; down
    again, CLIP's NULLs are the 0 that column held before."""
    from tests.report.fakes import Page, make_run

    db = open_database(sqlite_url)
    v1 = make_run(db, tmp_path / "v1", make_png, {("p.png", 0): Page()})
    ocr2_page = {("p.png", 0): Page(encoder="qwen2_ms")}
    ocr2 = make_run(db, tmp_path / "ocr2", make_png, ocr2_page, model="ocr2-tiny", mode="small")

    def encoders() -> dict[str, tuple[float | None, float | None]]:
        with db.engine.connect() as connection:
            rows = connection.execute(text("SELECT run_id, clip_ms, qwen2_ms FROM results")).all()
        return {run_id: (clip, qwen2) for run_id, clip, qwen2 in rows}

    assert encoders() == {v1: (2.0, None), ocr2: (None, 2.0)}
    config = alembic_config(db.url)
    with db.engine.begin() as connection:
        config.attributes["connection"] = connection
        command.downgrade(config, "0016")
    with db.engine.begin() as connection:  # as the engine wrote them before 0017
        connection.execute(text("UPDATE results SET qwen2_ms = 0 WHERE run_id = :run"), {"run": v1})
    assert encoders() == {v1: (2.0, 0.0), ocr2: (0.0, 2.0)}
    upgrade(db)
    assert encoders() == {v1: (2.0, None), ocr2: (None, 2.0)}
    db.dispose()


def test_a_batched_rows_stages_stored_as_0_become_null(sqlite_url, tmp_path, make_png):
    """0018: a batched run's rows, which stored 0 for every device stage (its prefill too: no stage of
    its own was timed), hold NULL there, a batch-1 run's times kept; down again, the 0s come back (its
    family's encoder's too, the other family's staying NULL as 0017 left it)."""
    from tests.report.fakes import Page, make_run

    db = open_database(sqlite_url)
    alone = make_run(db, tmp_path / "alone", make_png, {("p.png", 0): Page()})
    batched = make_run(db, tmp_path / "batched", make_png, {("p.png", 0): Page()}, concurrency=3)
    columns = ("setup_ms", "prefill_ms", "vision_ms", "sam_ms", "clip_ms", "qwen2_ms", "projector_ms",
               "lm_prefill_ms", "first_token_ms", "decode_ms", "wasted_decode_ms", "readback_ms")  # fmt: skip

    def stages() -> dict[str, tuple[float | None, ...]]:
        with db.engine.connect() as connection:
            rows = connection.execute(text(f"SELECT run_id, {', '.join(columns)} FROM results")).all()
        return {run_id: tuple(values) for run_id, *values in rows}

    measured = stages()[alone]
    assert measured[1] > 0 and measured[columns.index("qwen2_ms")] is None
    config = alembic_config(db.url)
    with db.engine.begin() as connection:
        config.attributes["connection"] = connection
        command.downgrade(config, "0017")
    zeros = ", ".join(f"{c} = 0" for c in columns if c != "qwen2_ms")
    with db.engine.begin() as connection:  # as the batched engine wrote its rows before 0018
        connection.execute(text(f"UPDATE results SET {zeros} WHERE run_id = :run"), {"run": batched})
    before = (0.0,) * 5 + (None,) + (0.0,) * 6
    assert stages() == {alone: measured, batched: before}
    upgrade(db)
    assert stages() == {alone: measured, batched: (None,) * len(columns)}
    nullable = {c["name"]: c["nullable"] for c in inspect(db.engine).get_columns("results")}
    assert all(nullable[c] for c in columns)
    with db.engine.begin() as connection:
        config.attributes["connection"] = connection
        command.downgrade(config, "0017")
    assert stages() == {alone: measured, batched: before}
    db.dispose()
