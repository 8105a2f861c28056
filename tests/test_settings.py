"""The settings registry (dsocr_workers/settings.py) is the one place where an environment variable is
named: the README's configuration table is generated from it, and no other module of the package names a
`DSOCR_*` variable."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dsocr_workers import settings
from dsocr_workers.errors import InputError

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "dsocr_workers"


def test_readme_configuration_table_is_the_registry() -> None:
    assert settings.markdown_table() in (REPO / "README.md").read_text(encoding="utf-8")


def test_every_variable_the_package_names_is_registered() -> None:
    registered = {v.name for v in settings.VARIABLES}
    named: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name == "settings.py" and path.parent == PACKAGE:
            continue
        for name in re.findall(r"\bDSOCR_[A-Z_]+\b", path.read_text(encoding="utf-8")):
            named.setdefault(name, set()).add(str(path.relative_to(REPO)))
    assert {name: files for name, files in named.items() if name not in registered} == {}


def test_every_variable_the_package_reads_by_name_is_registered() -> None:
    """Other programs' variables too (CUDA's, torch's, Python's): a literal name read from, or set in,
    the environment anywhere in the package."""
    registered = {v.name for v in settings.VARIABLES}
    pattern = re.compile(r"""(?:environ|getenv)(?:\.get)?[\[(]\s*["']([A-Z][A-Z0-9_]+)["']""")
    named = {name for path in PACKAGE.rglob("*.py") for name in pattern.findall(path.read_text(encoding="utf-8"))}
    assert named and named - registered == set()


def test_read_parses_and_defaults() -> None:
    assert settings.read(settings.MAX_ATTEMPTS, {}) == 3
    assert settings.read(settings.MAX_ATTEMPTS, {"DSOCR_MAX_ATTEMPTS": ""}) == 3
    assert settings.read(settings.MAX_ATTEMPTS, {"DSOCR_MAX_ATTEMPTS": "5"}) == 5
    assert settings.read(settings.INSTRUMENTATION, {"DSOCR_INSTRUMENTATION": "0"}) is False
    assert settings.read(settings.COMPILE_CACHE_DIR, {"DSOCR_COMPILE_CACHE_DIR": "/x"}) == Path("/x")
    with pytest.raises(InputError, match="DSOCR_MAX_ATTEMPTS must be an integer"):
        settings.read(settings.MAX_ATTEMPTS, {"DSOCR_MAX_ATTEMPTS": "many"})
    with pytest.raises(InputError, match="DSOCR_INSTRUMENTATION must be 0 or 1"):
        settings.read(settings.INSTRUMENTATION, {"DSOCR_INSTRUMENTATION": "off"})


def test_the_match_time_limit_is_seconds_or_none() -> None:
    assert settings.read(settings.MATCH_TIME_LIMIT, {}) == 30.0  # the official evaluator's
    assert settings.read(settings.MATCH_TIME_LIMIT, {"DSOCR_MATCH_TIME_LIMIT": "0.5"}) == 0.5
    assert settings.read(settings.MATCH_TIME_LIMIT, {"DSOCR_MATCH_TIME_LIMIT": "none"}) is None
    for bad in ("0", "-1", "soon", "inf", "nan"):
        with pytest.raises(InputError, match="DSOCR_MATCH_TIME_LIMIT"):
            settings.read(settings.MATCH_TIME_LIMIT, {"DSOCR_MATCH_TIME_LIMIT": bad})


def test_farm_settings_come_from_the_registry() -> None:
    farm = settings.Settings.from_env({"DSOCR_HARD_TIME_LIMIT": "100", "DSOCR_QUEUE": "q7"})
    assert (farm.hard_time_limit_s, farm.soft_time_limit_s, farm.queue) == (100, 90, "q7")
    assert settings.Settings.from_env({}) == settings.Settings()
