"""A run by the name a user gives it on the command line: its id, a unique prefix of it, or `latest`."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from dsocr_workers.errors import InputError
from dsocr_workers.store.models import Run


def resolve_run(tx: Session, ref: str) -> Run:
    """A run by id, by unique id prefix, or `latest`."""
    if ref == "latest":
        run = tx.scalars(select(Run).order_by(Run.created_at.desc()).limit(1)).first()
        if run is None:
            raise InputError("there is no run yet")
        return run
    run = tx.get(Run, ref)
    if run is not None:
        return run
    matches = tx.scalars(select(Run).where(Run.id.startswith(ref, autoescape=True)).limit(2)).all()
    if len(matches) == 1:
        return matches[0]
    raise InputError(f"no run {ref!r}" if not matches else f"run id prefix {ref!r} is ambiguous")
