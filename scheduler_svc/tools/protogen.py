"""Generate the Python stubs of `protos/` into `scheduler_svc/_gen/` (run by the build).

    python -m scheduler_svc.tools.protogen            # writes scheduler_svc/_gen
    python -m scheduler_svc.tools.protogen --check    # exits 1 if scheduler_svc/_gen is stale

protoc writes imports as `from scheduler.v1 import ...`; the generated modules live inside this
package, so those import lines are re-rooted under `scheduler_svc._gen`. Nothing else changes.
"""

from __future__ import annotations

import argparse
import filecmp
import re
import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ROOT / "protos"
TARGET = Path(__file__).resolve().parents[1] / "_gen"
_IMPORT = re.compile(r"^from scheduler(\.\w+)* import ", re.M)


def generate(out_dir: Path, protos: Path = PROTOS) -> list[Path]:
    """Compile every .proto under `protos` into `out_dir`; return the files written."""
    from grpc_tools import protoc  # noqa: PLC0415 - a build-time dependency only

    sources = sorted(str(p.relative_to(protos)) for p in protos.rglob("*.proto"))
    include = str(resources.files("grpc_tools") / "_proto")
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{protos}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {sources}")
    written = []
    for path in sorted(out_dir.rglob("*.py*")):
        text = path.read_text()
        fixed = _IMPORT.sub(
            lambda m: m.group(0).replace("from scheduler", "from scheduler_svc._gen.scheduler", 1),
            text,
        )
        path.write_text(fixed)
        written.append(path)
    for folder in [out_dir, *(p for p in out_dir.rglob("*") if p.is_dir())]:
        init = folder / "__init__.py"
        if not init.exists():
            init.write_text(
                '"""Generated from protos/ by scheduler_svc.tools.protogen; do not edit."""\n'
            )
            written.append(init)
    return written


def is_current(target: Path = TARGET) -> bool:
    """Whether `target` holds exactly what the protos generate now."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        generate(fresh)
        for path in fresh.rglob("*"):
            if path.is_file():
                other = target / path.relative_to(fresh)
                if not other.is_file() or not filecmp.cmp(path, other, shallow=False):
                    return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description="generate scheduler_svc/_gen from protos/")
    parser.add_argument("--check", action="store_true", help="only check that _gen is current")
    args = parser.parse_args()
    if args.check:
        if is_current():
            return 0
        print(
            "scheduler_svc/_gen is stale: run python -m scheduler_svc.tools.protogen",
            file=sys.stderr,
        )
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        shutil.rmtree(TARGET, ignore_errors=True)
        shutil.copytree(tmp, TARGET)
    return 0


if __name__ == "__main__":
    sys.exit(main())
