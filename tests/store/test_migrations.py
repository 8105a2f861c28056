"""The migrations build exactly the schema the models describe, on SQLite and PostgreSQL, and the newest
one goes down and up again without loss of the older columns."""

from __future__ import annotations

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from dsocr_workers.store.db import alembic_config, current_revision, head_revision, open_database, upgrade
from dsocr_workers.store.models import Base


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
