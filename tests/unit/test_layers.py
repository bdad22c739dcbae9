"""The layer contract: each part of the package imports only the parts beneath it, so data and
dependencies run one way (README's layout). `test_build` checks, beyond this, that the core,
the simulator and the cost profiles use the standard library alone."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("scheduler_svc", "reference_engine")
BELOW_SERVING = {"core", "profiles", "contracts", "errors", "config", "_gen"}
# Part -> the parts it may import besides itself and the package's own `__init__` (its version).
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "profiles": set(),
    "contracts": {"core", "profiles"},
    "errors": set(),
    "config": {"core", "contracts", "errors", "profiles"},
    "sim": {"core", "profiles"},
    "reference_engine": {"core", "profiles", "contracts"},
    "serving": BELOW_SERVING,
    "testing": BELOW_SERVING | {"serving"},
    "tools": BELOW_SERVING | {"serving", "testing", "sim"},
    "cli": BELOW_SERVING | {"serving", "sim", "tools"},
}


def _part(module: str) -> str:
    """`scheduler_svc.serving.fronts.http` -> serving; `reference_engine.x` -> reference_engine;
    the package itself (its `__version__`) -> __init__."""
    top, _, rest = module.partition(".")
    if top == "reference_engine":
        return top
    return rest.split(".")[0] if rest else "__init__"


def _imports(path: Path, root: Path) -> set[str]:
    """The package modules `path` imports (`from scheduler_svc import x` names x where x is a
    module, else the package)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import (the layer test reads absolute ones)"
            base = (node.module or "").replace(".", "/")
            for alias in node.names:
                sub = root / base / alias.name
                is_module = sub.with_suffix(".py").exists() or sub.is_dir()
                names.add(f"{node.module}.{alias.name}" if is_module else str(node.module))
    return {n for n in names if n.split(".")[0] in PACKAGES}


def _modules(root: Path) -> list[tuple[Path, str]]:
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if "_gen" not in parts:
                found.append((path, ".".join(parts)))
    return found


def violations(root: Path) -> list[str]:
    """Each import under `root` that runs up a layer or into a part the contract does not name."""
    wrong = []
    for path, module in _modules(root):
        part = _part(module)
        if part not in ALLOWED and part != "__init__":
            wrong.append(f"{path.relative_to(root)}: part {part!r} has no place in ALLOWED")
        for name in _imports(path, root):
            target = _part(name)
            if target not in (part, "__init__") and target not in ALLOWED.get(part, set()):
                wrong.append(f"{path.relative_to(root)} ({part}) imports {name} ({target})")
    return wrong


def test_no_import_runs_up_a_layer() -> None:
    assert len(_modules(ROOT)) > 50
    assert violations(ROOT) == []


def test_an_upward_import_or_an_unplaced_part_is_found(tmp_path: Path) -> None:
    """The check is not vacuous: a config that imports the serving process, and a new part
    with no place in the contract, are both named."""
    for folder in ("scheduler_svc/serving", "scheduler_svc/extra", "reference_engine"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "scheduler_svc/serving/service.py").write_text("import json\n")
    (tmp_path / "scheduler_svc/config.py").write_text(
        "from scheduler_svc.serving import service\nfrom scheduler_svc import __version__\n"
    )
    (tmp_path / "scheduler_svc/extra/x.py").write_text("")
    assert violations(tmp_path) == [
        "scheduler_svc/config.py (config) imports scheduler_svc.serving.service (serving)",
        "scheduler_svc/extra/x.py: part 'extra' has no place in ALLOWED",
    ]
