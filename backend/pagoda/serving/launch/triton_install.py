"""Where tritonserver is, and the backend directory it needs (used by ``launcher``).

Two installs are supported:

- the ``nvidia-pytriton`` wheel (Triton 2.51 with the Python backend; ``pip install
  'pagoda[serve]'``), whose stubs are built per Python version;
- a system install (``$PAGODA_TRITONSERVER_DIR``, default ``/opt/tritonserver`` as in
  NVIDIA's container), whose Python backend holds a stub built for the container's Python.

``make_backend_dir`` builds a ``--backend-directory`` whose ``python/`` holds
``libtriton_python.so``, ``triton_python_backend_utils.py`` and the stub.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

STUB_NAME = "triton_python_backend_stub"


def default_model_repository() -> Path:
    """The repository shipped with the source tree (``<repo>/model_repository``)."""
    env = os.environ.get("PAGODA_MODEL_REPOSITORY")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[4] / "model_repository"


@dataclass
class TritonPaths:
    binary: Path
    libs: Path
    python_backend: Path  # holds libtriton_python.so and triton_python_backend_utils.py
    stub: Path


def find_tritonserver() -> TritonPaths:
    """Locate tritonserver: the one in the ``nvidia-pytriton`` wheel, else a system
    install (``$PAGODA_TRITONSERVER_DIR``, default ``/opt/tritonserver`` as in NVIDIA's
    container, whose Python backend holds a stub built for the container's Python).

    Raises:
        RuntimeError: neither is installed, or the one found has no stub for this Python.
    """
    try:
        import pytriton
    except ImportError:
        system = Path(os.environ.get("PAGODA_TRITONSERVER_DIR", "/opt/tritonserver"))
        if not (system / "bin" / "tritonserver").exists():
            raise RuntimeError("pagoda serve needs tritonserver: pip install 'pagoda[serve]' (nvidia-pytriton), "
                               "or NVIDIA's container (/opt/tritonserver)") from None
        backend = system / "backends" / "python"
        paths = TritonPaths(binary=system / "bin" / "tritonserver", libs=system / "lib", python_backend=backend,
                            stub=backend / STUB_NAME)
    else:
        root = Path(pytriton.__file__).resolve().parent / "tritonserver"
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        paths = TritonPaths(
            binary=root / "bin" / "tritonserver",
            libs=root.parent.parent / "nvidia_pytriton.libs",
            python_backend=root / "backends" / "python",
            stub=root / "python_backend_stubs" / version / STUB_NAME,
        )
    for path in (paths.binary, paths.python_backend, paths.stub):
        if not path.exists():
            raise RuntimeError(f"tritonserver is incomplete: {path} is missing")
    return paths


def make_backend_dir(paths: TritonPaths, dest: Path) -> Path:
    """Build a ``--backend-directory`` with the Python backend and this Python's stub."""
    python_dir = dest / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        shutil.copy2(paths.python_backend / name, python_dir / name)
    shutil.copy2(paths.stub, python_dir / STUB_NAME)
    return dest
