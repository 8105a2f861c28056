"""Fixtures of the reliability suite: `new_farm(faults=…, **settings)` builds an isolated `Farm` (see
reliability_harness.py) whose workers are stopped and whose Redis keys are deleted after the test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from faulty_dsocr import NO_FAULTS, Faults
from reliability_harness import Farm

pytestmark = [pytest.mark.postgres, pytest.mark.redis]


@pytest.fixture
def new_farm(
    tmp_path: Path, postgres_url: str, subprocess_env: dict[str, str]
) -> Iterator[Callable[..., Farm]]:
    farms: list[Farm] = []

    def make(database_url: str | None = None, faults: Faults = NO_FAULTS, **settings: str) -> Farm:
        farm = Farm.create(
            tmp_path / f"farm{len(farms)}", database_url or postgres_url, subprocess_env, faults=faults,
            **settings,
        )
        farms.append(farm)
        return farm

    yield make
    for farm in farms:
        farm.stop()
        farm.delete_keys()
