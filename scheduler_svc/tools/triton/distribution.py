"""Finding and preparing the `tritonserver` bundled in the `nvidia-pytriton` wheel.

The wheel ships the server binary, its shared libraries (`nvidia_pytriton.libs`), the Python
backend, and one backend stub per CPython version. A launch needs a backend directory whose
`python/` folder holds the backend and the stub for *this* interpreter; the stub then embeds
this interpreter's libpython and finds this virtual environment through `PATH`.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from scheduler_svc.errors import BackendStubMissingError, TritonNotInstalledError

_PY_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"


@dataclass(frozen=True)
class TritonDistribution:
    """Paths inside an installed `nvidia-pytriton` wheel."""

    root: Path  # .../site-packages/pytriton/tritonserver

    @classmethod
    def locate(cls) -> TritonDistribution:
        """Find the installed wheel, or raise an error that says how to get it."""
        spec = importlib.util.find_spec("pytriton")
        if spec is None or not spec.submodule_search_locations:
            raise TritonNotInstalledError(
                "the bundled tritonserver is not installed: install the `triton` extra "
                "(pip install 'scheduler-svc[triton]', which pulls nvidia-pytriton==0.7.0)"
            )
        root = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
        dist = cls(root)
        if not dist.binary.is_file():
            raise TritonNotInstalledError(f"tritonserver binary not found at {dist.binary}")
        return dist

    @property
    def binary(self) -> Path:
        return self.root / "bin" / "tritonserver"

    @property
    def libs(self) -> Path:
        return self.root.parent.parent / "nvidia_pytriton.libs"

    @property
    def python_backend(self) -> Path:
        return self.root / "backends" / "python"

    @property
    def stub(self) -> Path:
        return self.root / "python_backend_stubs" / _PY_VERSION / "triton_python_backend_stub"

    def prepare_backends(self, workdir: Path) -> Path:
        """Lay out a backend directory for this interpreter under `workdir` and return it."""
        if not self.stub.is_file():
            have = sorted(p.name for p in self.stub.parent.parent.glob("*"))
            raise BackendStubMissingError(
                f"no Python backend stub for Python {_PY_VERSION} at {self.stub} "
                f"(the wheel has stubs for {', '.join(have) or 'no version'})"
            )
        target = workdir / "backends" / "python"
        target.mkdir(parents=True, exist_ok=True)
        for item in self.python_backend.iterdir():
            if item.is_file():
                (target / item.name).symlink_to(item)
        shutil.copy2(self.stub, target / "triton_python_backend_stub")
        return workdir / "backends"

    def environment(self) -> dict[str, str]:
        """Environment for tritonserver: its libraries, this libpython, this venv first on PATH."""
        env = dict(os.environ)
        libdirs = [str(self.libs)]
        py_libdir = sysconfig.get_config_var("LIBDIR")
        if py_libdir and any(Path(py_libdir).glob(f"libpython{_PY_VERSION}*.so*")):
            libdirs.append(py_libdir)
        if env.get("LD_LIBRARY_PATH"):
            libdirs.append(env["LD_LIBRARY_PATH"])
        env["LD_LIBRARY_PATH"] = os.pathsep.join(libdirs)
        # The stub's embedded interpreter locates its prefix (and so this venv's packages)
        # from the first `python3` on PATH.
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        # One torch thread per engine instance unless the model config says otherwise.
        env.setdefault("OMP_NUM_THREADS", "1")
        return env
