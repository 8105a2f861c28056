import ast
import importlib
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import dsocr_workers
from dsocr_workers import errors
from dsocr_workers.cli import main

REPO = Path(__file__).resolve().parents[1]
PACKAGES = sorted(info.name for info in pkgutil.iter_modules(dsocr_workers.__path__) if info.ispkg)
DOCS = [REPO / "README.md", REPO / "benchmarks" / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_error_tree_exit_codes():
    assert issubclass(errors.CheckpointError, errors.InputError)
    assert {errors.InputError.exit_code, errors.TransientError.exit_code, errors.FailuresError.exit_code} == {
        2,
        3,
        4,
    }


def test_cli_version():
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0
    assert dsocr_workers.__version__ in result.output


# --- public names: each package's `__all__` is what its __init__ re-exports, no more, no less ----------


def reexported(package: str) -> list[str]:
    """The names a package's __init__ imports from its own modules: at import time, for type checking
    or lazily in a module `__getattr__`."""
    init = Path(importlib.import_module(f"dsocr_workers.{package}").__file__ or "")
    names = []
    for node in ast.walk(ast.parse(init.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(f"dsocr_workers.{package}."):
            names += [alias.asname or alias.name for alias in node.names]
    return names


def test_packages_are_found():
    assert {"engine", "farm", "model", "store"} <= set(PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_all_lists_exactly_the_public_reexports(package):
    module = importlib.import_module(f"dsocr_workers.{package}")
    exported = list(getattr(module, "__all__", []))
    assert len(exported) == len(set(exported)), "a name listed twice"
    assert not [name for name in exported if name.startswith("_")], "a private name exported"
    assert sorted(exported) == sorted({name for name in reexported(package) if not name.startswith("_")})


@pytest.mark.parametrize("package", PACKAGES)
def test_every_exported_name_resolves_to_the_package(package):
    module = importlib.import_module(f"dsocr_workers.{package}")
    for name in getattr(module, "__all__", []):
        value = getattr(module, name)  # a lazy name goes through the package's __getattr__
        assert value.__module__.startswith(f"dsocr_workers.{package}."), (name, value.__module__)


def test_the_engine_api_imports_without_torch():
    """The farm's parent process and the reports import the engine's result types; torch loads with
    the session, on first use (resolved above)."""
    probe = "import sys, dsocr_workers.engine; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def documented_names() -> list[tuple[str, str]]:
    """(document, dotted name) for every `dsocr_workers.…` name and `from dsocr_workers.… import …` the
    documentation gives readers to use."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for module, names in re.findall(r"from (dsocr_workers[\w.]*) import ([\w,\s]+)", text):
            found += [(doc.name, f"{module}.{name}") for name in re.findall(r"\w+", names)]
        found += [(doc.name, dotted) for dotted in re.findall(r"\bdsocr_workers(?:\.\w+)+", text)]
    return found


def resolve(dotted: str) -> object:
    """Import the longest module prefix of `dotted`, then follow the rest as attributes."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            value: object = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[split:]:
            value = getattr(value, attribute)
        return value
    raise ModuleNotFoundError(dotted)


def test_documented_names_exist():
    documented = documented_names()
    assert any(name.startswith("dsocr_workers.report.throughput.") for _, name in documented)
    missing = []
    for doc, name in documented:
        try:
            resolve(name)
        except (ImportError, AttributeError):
            missing.append((doc, name))
    assert not missing
