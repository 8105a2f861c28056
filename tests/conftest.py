"""Shared fixtures. Every test session gets its own PostgreSQL database and its own Redis key prefix and
queue, so parallel runs on one machine never see each other's rows or messages.

- `postgres_url`: a fresh database `dsocr_test_<random>` on 127.0.0.1:5432 (migrated), dropped at the end.
- `sqlite_url`: a migrated SQLite file in the test's tmp dir.
- `database` (parametrised sqlite / postgres): an open, migrated `Database`; PostgreSQL tables are
  emptied after each test.
- `broker_env`: DSOCR_* variables for a unique Redis key prefix and queue; its keys are deleted at the end.
- `make_png`: writes small PNG pages with Pillow.
- `write_omnidocbench`: writes a hand-made annotation file in OmniDocBench's JSON layout.

Tests marked `slow` (the long reliability scenarios) run only with `--run-slow`. The longest tests and
folders are collected first (LONGEST, LONG_FIRST), for pytest-xdist's sake.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

# Without a GPU, Triton kernels (the fast engine's, model/selected_experts.py) run in Triton's
# interpreter; it must be chosen before the kernels are defined, i.e. before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-slow", action="store_true", help="also run the long scenarios (marked slow): see docs/reliability.md"
    )


# The longest tests, longest first (one to four minutes each on this machine, waiting on worker processes,
# leases, compilation or Chromium), then the folders whose tests do the same for tens of seconds each.
# pytest-xdist (scripts/test.sh: `-n 3 --dist loadgroup`) hands tests out one by one in collection order:
# one of these started last would leave the other processes idle at the end.
LONGEST = (
    "engine/test_coldstart_build.py::test_a_build_makes_packages",
    "reliability/test_r2_r3_kills.py",
    "engine/test_batched.py",
    "farm/test_workers.py",
    "reliability/test_r7_to_r10_jobs.py",
    "report/test_html.py::test_html_report_of_a_cpu_run",
    "reliability/test_batched_kills.py",
    "engine/test_session.py",
)
LONG_FIRST = ("reliability", "engine", "farm")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent

    def rank(item: pytest.Item) -> int:
        if not item.path.is_relative_to(tests):
            return len(LONGEST) + len(LONG_FIRST)
        nodeid = "::".join([item.path.relative_to(tests).as_posix(), *item.nodeid.split("::")[1:]])
        longest = next((i for i, prefix in enumerate(LONGEST) if nodeid.startswith(prefix)), None)
        if longest is not None:
            return longest
        folder = item.path.relative_to(tests).parts[0]
        return len(LONGEST) + (LONG_FIRST.index(folder) if folder in LONG_FIRST else len(LONG_FIRST))

    items.sort(key=rank)  # stable: each folder keeps its own order
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="long scenario: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


PG_SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432"
REDIS_URL = "redis://127.0.0.1:6379/0"


def _admin_execute(sql: str) -> None:
    import psycopg

    with psycopg.connect("host=127.0.0.1 port=5432 user=postgres dbname=postgres", autocommit=True) as conn:
        conn.execute(sql)


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    from dsocr_workers.store.db import open_database, upgrade

    name = f"dsocr_test_{uuid.uuid4().hex[:10]}"
    try:
        _admin_execute(f"CREATE DATABASE {name}")
    except Exception as exc:  # the suite is written for a machine with PostgreSQL: say so loudly
        pytest.fail(f"PostgreSQL at 127.0.0.1:5432 is needed (scripts/services.sh starts it): {exc}")
    url = f"{PG_SERVER}/{name}"
    db = open_database(url)
    upgrade(db)
    db.dispose()
    yield url
    _admin_execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    from dsocr_workers.store.db import open_database, upgrade

    url = f"sqlite:///{tmp_path / 'dsocr.db'}"
    db = open_database(url)
    upgrade(db)
    db.dispose()
    return url


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database(request: pytest.FixtureRequest):
    from sqlalchemy import text

    from dsocr_workers.store.db import open_database

    url = request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "postgres_url")
    db = open_database(url)

    def empty() -> None:
        with db.engine.begin() as conn:
            conn.execute(text("TRUNCATE results, jobs, worker_sessions, worker_processes, workers, runs CASCADE"))

    if request.param == "postgres":
        # The session's database is shared by the tests of one pytest process: tests that take
        # `postgres_url` themselves (the farm's) leave their runs there.
        empty()
    yield db
    if request.param == "postgres":
        empty()
    db.dispose()


@pytest.fixture(scope="session")
def broker_env() -> Iterator[dict[str, str]]:
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.fail(f"Redis at 127.0.0.1:6379 is needed (scripts/services.sh starts it): {exc}")
    tag = uuid.uuid4().hex[:10]
    prefix = f"dsocr-test-{tag}:"
    yield {
        "DSOCR_BROKER_URL": REDIS_URL,
        "DSOCR_BROKER_KEY_PREFIX": prefix,
        "DSOCR_QUEUE": f"dsocr-test-{tag}",
    }
    keys = list(client.scan_iter(match=f"{prefix}*"))
    if keys:
        client.delete(*keys)


@pytest.fixture
def make_png(tmp_path: Path) -> Callable[..., Path]:
    from PIL import Image, ImageDraw

    def make(name: str, size: tuple[int, int] = (320, 420), folder: Path | None = None) -> Path:
        path = (folder or tmp_path / "images") / name
        path.parent.mkdir(parents=True, exist_ok=True)
        page = Image.new("RGB", size, "white")
        draw = ImageDraw.Draw(page)
        draw.text((20, 20), f"Page {name}", fill="black")
        draw.rectangle((20, 60, size[0] - 20, size[1] // 2), outline="black")
        page.save(path, format="PNG")
        return path

    return make


@pytest.fixture
def subprocess_env() -> dict[str, str]:
    """The environment for `python -m dsocr_workers …` subprocesses: this checkout first on the path."""
    repo = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([repo, *filter(None, [env.get("PYTHONPATH")])])
    return env


# One block of a hand-made annotation: (category_type, content, order). The content goes where
# OmniDocBench keeps it: `latex` for display formulas, `html` for tables, `text` for everything else.
Block = tuple[str, str, int | None]
_CONTENT_FIELD = {"equation_isolated": "latex", "table": "html"}


def omnidocbench_page(image: str, blocks: list[Block], truncated: list[tuple[int, int]] = ()) -> dict[str, Any]:
    """One page in OmniDocBench's layout; `truncated` links blocks (by index) split across columns."""
    dets = []
    for index, (category, content, order) in enumerate(blocks):
        det: dict[str, Any] = {"category_type": category, "anno_id": index, "order": order, "ignore": False,
                               "poly": [0, 0, 10, 0, 10, 10, 0, 10], "attribute": {}}
        det[_CONTENT_FIELD.get(category, "text")] = content
        dets.append(det)
    relations = [{"source_anno_id": a, "target_anno_id": b, "relation": "parent_son", "relation_type": "truncated"}
                 for a, b in truncated]
    return {"layout_dets": dets, "extra": {"relation": relations},
            "page_info": {"page_no": 0, "height": 2000, "width": 1600, "image_path": image,
                          "page_attribute": {"language": "english"}}}


@pytest.fixture
def write_omnidocbench(tmp_path: Path) -> Callable[..., Path]:
    """write({image: [blocks]}, truncated={image: [(i, j)]}) -> the annotation file's path."""

    def write(pages: dict[str, list[Block]], truncated: dict[str, list[tuple[int, int]]] | None = None,
              name: str = "OmniDocBench.json") -> Path:
        path = tmp_path / name
        entries = [omnidocbench_page(image, blocks, (truncated or {}).get(image, [])) for image, blocks in pages.items()]
        path.write_text(json.dumps(entries, ensure_ascii=False), encoding="utf-8")
        return path

    return write


@pytest.fixture
def page_list(tmp_path: Path, make_png: Callable[..., Path]) -> Callable[[dict[str, tuple[int, int]]], Path]:
    """A file list of PNG pages {name: size} written under tmp_path/pages."""

    def make(pages: dict[str, tuple[int, int]]) -> Path:
        folder = tmp_path / "pages"
        for name, size in pages.items():
            make_png(name, size, folder=folder)
        listing = folder / "pages.txt"
        listing.write_text("\n".join(pages) + "\n")
        return listing

    return make
