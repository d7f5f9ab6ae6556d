"""The benchmark scripts' wiring: every name they import from the project still exists.

The scripts are run by hand (their numbers are quoted in the README and docs), so nothing else notices when a
function they use is renamed or moved; many import inside the function that needs it, where loading the module does
not reach. Reading their imports from the source covers those too.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).parents[1] / "benchmarks").glob("*.py"))
PROJECT_PACKAGES = {"dxr", "models", "tasks", "tools", "warehouse"}


def project_imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) of every `from <project module> import <name>` in the script, at any depth."""
    return [(node.lineno, node.module, alias.name)
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
            and node.module.split(".")[0] in PROJECT_PACKAGES
            for alias in node.names]


def test_project_imports_reach_into_functions(tmp_path):
    script = tmp_path / "bench.py"
    script.write_text("import json\nfrom pathlib import Path\nfrom warehouse.store import Warehouse\n\n\n"
                      "def main():\n    from tasks.evaluate import evaluate, load_run\n")
    assert project_imports(script) == [(3, "warehouse.store", "Warehouse"), (7, "tasks.evaluate", "evaluate"),
                                       (7, "tasks.evaluate", "load_run")]


def resolves(module_name: str, name: str) -> bool:
    """`from module_name import name` works: an attribute, or a submodule of a package."""
    module = importlib.import_module(module_name)
    return hasattr(module, name) or (hasattr(module, "__path__")
                                     and importlib.util.find_spec(f"{module_name}.{name}") is not None)


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_benchmark_imports_resolve(path):
    missing = [f"{path.name}:{line}: from {module_name} import {name}"
               for line, module_name, name in project_imports(path) if not resolves(module_name, name)]
    assert not missing, "benchmark imports that no longer exist: " + "; ".join(missing)


def load_benchmark(name: str):
    path = Path(__file__).parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mimic_import_leaves_the_rest_of_a_given_workdir(tmp_path, monkeypatch):
    """benchmarks/mimic_import.py --workdir D without --keep removes the files it generated there, not D."""
    mimic_import = load_benchmark("mimic_import")
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / "notes.txt").write_text("the caller's")
    monkeypatch.setattr(mimic_import, "RESULTS", tmp_path / "results")
    monkeypatch.setattr("sys.argv", ["mimic_import.py", "--scale", "0.0002", "--prescriptions", "5000",
                                     "--workdir", str(workdir)])
    mimic_import.main()
    assert sorted(p.name for p in workdir.iterdir()) == ["notes.txt"]
    record = json.loads((tmp_path / "results" / "mimic_import.json").read_text())
    assert (record["rows_per_table"]["patients"], record["rows_per_table"]["admissions"]) == (60, 86)
