import ast
import importlib
import importlib.util
import pkgutil
import re
import subprocess
import sys
import tomllib
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
    """`dsocr --version` prints the project's version as pyproject.toml declares it."""
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0
    assert result.output.split()[-1] == declared == dsocr_workers.__version__


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


# The packages with a public API of their own (`__all__`); the others are used through their modules.
API_PACKAGES = [name for name in PACKAGES if hasattr(importlib.import_module(f"dsocr_workers.{name}"), "__all__")]


def test_packages_are_found():
    assert {"engine", "farm", "model", "store"} <= set(PACKAGES)
    assert "engine" in API_PACKAGES


def test_packages_without_all_reexport_nothing():
    assert {package: reexported(package) for package in PACKAGES if package not in API_PACKAGES} == {
        package: [] for package in PACKAGES if package not in API_PACKAGES
    }


@pytest.mark.parametrize("package", API_PACKAGES)
def test_all_lists_exactly_the_public_reexports(package):
    module = importlib.import_module(f"dsocr_workers.{package}")
    exported = list(getattr(module, "__all__", []))
    assert len(exported) == len(set(exported)), "a name listed twice"
    assert not [name for name in exported if name.startswith("_")], "a private name exported"
    assert sorted(exported) == sorted({name for name in reexported(package) if not name.startswith("_")})


@pytest.mark.parametrize("package", API_PACKAGES)
def test_every_exported_name_resolves_to_the_package(package):
    module = importlib.import_module(f"dsocr_workers.{package}")
    assert module.__all__
    for name in module.__all__:
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


# --- code the documentation names by file and by class -------------------------------------------------

# The documents that describe the code as it is now (docs/history/ is the record of older runs).
CURRENT_DOCS = [REPO / "README.md", REPO / "docs" / "architecture.md", REPO / "docs" / "reliability.md",
                REPO / "docs" / "benchmarks.md", REPO / "benchmarks" / "README.md", REPO / "deploy" / "README.md"]
# A package file (`farm/devices.py`, `dsocr_workers/settings.py`), and the code name that may follow it
# (`farm/devices.py see_only_this_gpu`, `engine/session.py DeepSeekOCRSession.prefill`).
PATH_AND_NAME = re.compile(
    r"(?<![\w/])((?:dsocr_workers/)?(?:cli|farm|engine|model|store|report|quality)/[\w/]+\.py|"
    r"(?:dsocr_workers/)?(?:settings|errors)\.py)(?:`? `?([A-Za-z_]\w*(?:\.\w+)?)`?)?"
)
CLASS_MEMBER = re.compile(r"`([A-Z]\w+)\.(\w+)`")


def definitions(path: Path) -> dict[str, set[str]]:
    """A module's top-level names, each class with the names its body defines."""
    names: dict[str, set[str]] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef):
            names[node.name] = {
                target.id if isinstance(target, ast.Name) else getattr(target, "name", "")
                for member in node.body
                for target in (member.targets if isinstance(member, ast.Assign)
                               else [member.target] if isinstance(member, ast.AnnAssign) else [member])
            }  # fmt: skip
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names[node.name] = set()
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    names[target.id] = set()
    return names


def is_code_name(word: str) -> bool:
    """A name, not an English word after a path: CamelCase, snake_case or dotted."""
    return word[0].isupper() or "_" in word or "." in word


def test_documented_files_and_names_exist():
    missing = []
    for doc in CURRENT_DOCS:
        for path_text, name in PATH_AND_NAME.findall(doc.read_text()):
            path = REPO / (path_text if path_text.startswith("dsocr_workers/") else f"dsocr_workers/{path_text}")
            if not path.exists():
                missing.append((doc.name, path_text))
            elif name and is_code_name(name):
                head, _, member = name.partition(".")
                defined = definitions(path)
                if head not in defined or (member and member not in defined[head]):
                    missing.append((doc.name, f"{path_text} {name}"))
    assert missing == []


def test_documented_class_members_exist():
    classes: dict[str, set[str]] = {}
    for path in [*(REPO / "dsocr_workers").rglob("*.py"), *(REPO / "tests").rglob("*.py")]:
        for name, members in definitions(path).items():
            classes.setdefault(name, set()).update(members)
    cited = [(doc.name, cls, member) for doc in CURRENT_DOCS for cls, member in CLASS_MEMBER.findall(doc.read_text())]
    assert any(cls == "InferenceResult" for _, cls, _ in cited)
    assert [(doc, f"{cls}.{member}") for doc, cls, member in cited
            if cls in classes and member not in classes[cls]] == []  # fmt: skip


def is_submodule(dotted: str) -> bool:
    try:
        return importlib.util.find_spec(dotted) is not None
    except ModuleNotFoundError:  # the parent is a module, not a package
        return False


def test_every_import_of_the_package_resolves():
    """Imports inside functions (the CLI's, the workers') are not run by most tests and mypy, told to
    ignore missing imports, does not see a module that is gone: each `from dsocr_workers.… import name`
    in the package, the tests and the benchmarks must name a module and a name that exist."""
    broken = []
    for path in [*(REPO / "dsocr_workers").rglob("*.py"), *(REPO / "tests").rglob("*.py"),
                 *(REPO / "benchmarks").rglob("*.py")]:  # fmt: skip
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dsocr_workers"):
                try:
                    module = importlib.import_module(node.module or "")
                except ImportError as exc:
                    broken.append((str(path.relative_to(REPO)), node.module, str(exc)))
                    continue
                for alias in node.names:
                    if not hasattr(module, alias.name) and not is_submodule(f"{node.module}.{alias.name}"):
                        broken.append((str(path.relative_to(REPO)), node.module, alias.name))
    assert broken == []
