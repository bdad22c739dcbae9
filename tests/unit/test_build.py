"""What the build guarantees: current proto stubs, and a pure core (with the simulator and the
cost profiles both it and the reference engine read)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from scheduler_svc.tools import protogen

PACKAGE = Path(__file__).resolve().parents[2] / "scheduler_svc"
PURE = ("core", "sim", "profiles")


def test_generated_stubs_match_the_protos() -> None:
    assert protogen.is_current(), "scheduler_svc/_gen is stale: run `make` (protogen) again"


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_core_sim_and_profiles_import_only_the_standard_library_and_each_other() -> None:
    forbidden_stdlib = {"asyncio", "time", "os", "socket", "threading", "subprocess"}
    checked = 0
    for folder in PURE:
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            checked += 1
            for name in _imports(path):
                top = name.split(".")[0]
                if top == "scheduler_svc":
                    assert name.split(".")[1] in PURE, f"{path.name} imports {name}"
                else:
                    assert top in sys.stdlib_module_names or top == "__future__", (
                        f"{path.name} imports {name}, which is not in the standard library"
                    )
                    assert top not in forbidden_stdlib, f"{path.name} imports {name} (I/O or clock)"
    assert checked > 0
