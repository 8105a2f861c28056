"""The process that runs jobs: a Celery prefork child (one per device) or `dsocr run` itself.

It owns one device, one ledger connection (opened in this process, after fork) and one loaded model,
kept while consecutive jobs ask for the same model settings (model, dtype, engine, device).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from dsocr_workers.engine.result import DecodeOptions
from dsocr_workers.farm import faults
from dsocr_workers.farm.execute import Ran
from dsocr_workers.farm.fingerprint import environment_fingerprint
from dsocr_workers.settings import Settings
from dsocr_workers.store import ledger
from dsocr_workers.store.db import Database, database_for
from dsocr_workers.store.models import Worker, utcnow
from dsocr_workers.store.upsert import upsert

DEVICES_ENV = "DSOCR_WORKER_DEVICES"


@dataclass
class LoadedSession:
    key: tuple[Any, ...]
    session: Any  # DeepSeekOCRSession
    worker_id: str


@dataclass
class JobProcess:
    settings: Settings
    device: str
    db: Database
    owner: str = field(default_factory=ledger.process_owner)
    loaded: LoadedSession | None = None

    @classmethod
    def open(cls, settings: Settings, device: str, cpu_threads: int | None = None) -> JobProcess:
        if device == "cpu" and cpu_threads:
            import torch

            torch.set_num_threads(cpu_threads)
        return cls(settings=settings, device=device, db=database_for(settings.database_url))

    def session_for(self, model: str, parameters: dict[str, Any]) -> LoadedSession:
        key = (
            model,
            parameters.get("dtype"),
            parameters.get("engine", "eager"),
            parameters.get("seed", 0),
            self.device,
        )
        if self.loaded is not None and self.loaded.key == key:
            return self.loaded
        from dsocr_workers.engine.session import DeepSeekOCRSession

        self.loaded = None  # free the previous model before loading the next one
        session = DeepSeekOCRSession.from_local(
            model, device=self.device, dtype=key[1], engine=key[2], seed=key[3]
        )
        fingerprint = environment_fingerprint(self.device, session.source)
        with self.db.transaction() as tx:
            upsert(tx, Worker, {**fingerprint, "last_seen": utcnow()}, ["id"], ["last_seen"])
        self.loaded = LoadedSession(key, session, fingerprint["id"])
        return self.loaded

    def infer(self, claim: ledger.Claim) -> Ran:
        faults.inject(claim.image)  # test-only; a no-op unless DSOCR_TEST_FAULTS is set (farm/faults.py)
        p = claim.parameters
        loaded = self.session_for(claim.model, p)
        result = loaded.session.run_inference(
            str(claim.image_path),
            prompt=p.get("prompt"),
            mode=p.get("mode", "gundam"),
            max_new_tokens=p.get("max_new_tokens"),
            infer=DecodeOptions(ignore_eos=bool(p.get("ignore_eos", False))),
            job_id=claim.job_id,
        )
        return Ran(result, loaded.worker_id)


def devices_from_env() -> list[str]:
    return [d for d in os.environ.get(DEVICES_ENV, "cpu").split(",") if d]
