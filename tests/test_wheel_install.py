"""The package as users install it: a wheel built from the sources, installed into a fresh virtual
environment (its dependencies taken from this interpreter's site-packages, so nothing is downloaded),
migrates a database with `dsocr db upgrade` and runs a page with `dsocr run`, from outside the
checkout and with the extras' modules unimportable: the migrations (the checkout's top-level
migrations/, mapped into the package) and everything the model loads must be inside the wheel or among
its runtime dependencies."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from PIL import Image

REPO = Path(__file__).resolve().parents[1]
# The import name of each distribution the extras add (only the extras: `dsocr run` must not need them).
EXTRA_MODULES = {"psycopg": "psycopg", "matplotlib": "matplotlib", "flower": "flower", "pytest": "pytest", "pytest-xdist": "xdist",
                 "pytest-timeout": "pytest_timeout", "hypothesis": "hypothesis", "ruff": "ruff", "mypy": "mypy"}  # fmt: skip
# `dsocr run` with every extra's modules made unimportable, as in an install without extras.
# `dsocr run` with every extra's modules unimportable, as in an install without extras (a None entry in
# sys.modules: `import` raises ModuleNotFoundError, importlib.util.find_spec answers None).
WITHOUT_EXTRAS = """
import sys
for name in {blocked!r}:
    sys.modules[name] = None
from dsocr_workers.cli import main
sys.argv = ["dsocr", *sys.argv[1:]]
main()
"""


def extra_modules() -> set[str]:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0] for group in extras.values() for requirement in group}
    assert names <= set(EXTRA_MODULES), f"map the import name of {names - set(EXTRA_MODULES)} in EXTRA_MODULES"
    return {EXTRA_MODULES[name] for name in names}


def _run(*args: str | Path, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{args}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def test_a_built_wheel_migrates_and_runs_a_page_from_a_fresh_venv(tmp_path):
    source = tmp_path / "source"  # a clean copy: building writes build/ and *.egg-info beside the sources
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for name in ("dsocr_workers", "migrations"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path / "dist",
         source, cwd=tmp_path)  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("dsocr_workers-*.whl")
    # pyproject.toml lists the packages (the top-level migrations/ is mapped into the package): every
    # module of the checkout must be in the wheel, the migrations as dsocr_workers/migrations/.
    with zipfile.ZipFile(wheel) as archive:
        shipped = set(archive.namelist())
    sources = {f"dsocr_workers/{p.relative_to(source / 'dsocr_workers')}" for p in (source / "dsocr_workers").rglob("*.py")}
    migrations = {f"dsocr_workers/migrations/{p.relative_to(source / 'migrations')}"
                  for p in (source / "migrations").rglob("*") if p.suffix in (".py", ".mako")}  # fmt: skip
    assert "dsocr_workers/migrations/env.py" in migrations and "dsocr_workers/migrations/script.py.mako" in migrations
    assert sources | migrations | {"dsocr_workers/py.typed"} <= shipped, sorted((sources | migrations) - shipped)

    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    _run(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", wheel, cwd=tmp_path)

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["DSOCR_DATABASE_URL"] = f"sqlite:///{tmp_path / 'installed.db'}"
    work = tmp_path / "work"  # not the checkout: nothing may come from the sources
    work.mkdir()
    where = _run(python, "-c", "import dsocr_workers; print(dsocr_workers.__file__)", cwd=work, env=env)
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout  # the wheel, not an editable install

    dsocr = venv / "bin" / "dsocr"
    _run(dsocr, "db", "upgrade", cwd=work, env=env)
    Image.new("RGB", (320, 240), "white").save(work / "page.png")
    (work / "pages.txt").write_text("page.png\n")
    script = WITHOUT_EXTRAS.format(blocked=sorted(extra_modules()))
    done = _run(python, "-c", script, "run", "pages.txt", "--mode", "tiny", "--max-new-tokens", "2", "--format", "json",
                cwd=work, env=env)  # fmt: skip
    facts = {row["field"]: row["value"] for row in json.loads(done.stdout)["tables"]["Run"]}
    assert (facts["jobs"], facts["ok"], facts["results"]) == (1, 1, 1)
