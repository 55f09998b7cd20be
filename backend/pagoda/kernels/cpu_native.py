"""pagoda's C++ CPU kernels (issue 26), built on first use for the machine they run on.

- ``csrc/cpu_attention.cpp``: the paged decode attention of the torch (CPU) path. Each
  one-token query reads its context's K/V rows where they lie in the paged cache (no gather
  into a padded copy, no padding, no per-bucket SDPA call), all heads of a sequence per
  cached row, in float32 or bfloat16, with the sliding window and attention sinks. Built
  with AVX-512 and a head size that is a multiple of 16, it runs ``csrc/cpu_decode_tiles.h``
  (16 rows at a time, the next rows prefetched through the block table, a long context cut
  into parts that threads share and merged by log-sum-exp); otherwise portable loops, one
  sequence per work item. Work items go to threads longest first.
  ``reference.paged_attention_ref`` is its definition (tests/kernels/test_cpu_native.py
  checks it against that in float64). The torch path uses it for every decode row of a
  step whose cache is float32 or bfloat16 (an fp8 cache keeps the gather + SDPA path).
- ``csrc/cpu_prefill_attention.cpp`` (AVX-512 builds, head sizes 32-128): a prompt chunk's
  attention over its sequence's paged cache in place, flash-style (48-key tiles, an online
  softmax per query row, the heads of a KV group sharing each tile; tiles past a block's
  last key never read), with the window and sinks. The torch path uses it for every chunk
  that is plain causal (``native_prefill``); a chunk with an image's key limits keeps the
  gather + masked SDPA.
- ``csrc/cpu_elementwise.cpp``: the per-layer small ops, one call each instead of a chain
  of 5-12 torch ops: RMSNorm with the residual add, rotary embedding (reading q and k as
  strided views of the fused projection) and SwiGLU's ``silu(gate) * up``. Each rounds to
  the tensor's dtype where the torch expression it replaces does, so bfloat16 models keep
  torch's rounding steps; float32 results differ from torch's in the last bits only (sums
  in another order, a polynomial ``exp`` of torch's accuracy).
- ``csrc/cpu_gemm.cpp``, ``csrc/cpu_amx.cpp``: the CPU matmul on weights packed once
  (``pack_linear``, ``linear``; ``models/cpu_gemm.py`` packs a model's weights and chooses it
  where ``gemm_features()`` says its vector tiles run: AVX-512 for float32, AVX512-BF16 for
  bfloat16, AMX tiles for bfloat16 calls of 8+ rows where Linux grants them).
- ``csrc/cpu_int8.cpp`` (with the AMX-INT8 tiles in ``cpu_amx.cpp``): the W8A8 matmul of
  ``quantization="w8a8"`` (``models/w8a8.py``): activations quantized per row on every call,
  int8 x int8 summed exactly in int32 on AVX512-VNNI or AMX-INT8 tiles (``pack_int8``,
  ``linear_w8a8``, ``int8_features``).
- ``csrc/cpu_threads.cpp``: ``bind_threads``, each of torch's OpenMP threads bound to one CPU
  (``EngineConfig.cpu_threads_bind``, ``engine/thread_placement.py``).

Why C++: on the 2-core EPYC VM the gather + SDPA decode took ~2.3 s of a 10 s
``pagoda bench offline`` run at 2 threads (the gather alone 0.85 s), and the small ops
with their Python dispatch ~1.5 s; vLLM's CPU backend reads the paged cache in place with
its own C++ kernel and runs its small ops in a compiled graph (docs/benchmarks.md has the
profiles before and after).

Build: ``torch.utils.cpp_extension.load`` compiles the file once with ``-O3 -march=native
-fopenmp`` into torch's extension cache (``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``), under a name that hashes the sources, the flags, torch's
version and this CPU's model and flags (a home directory shared between machines never
loads another CPU's build; an edited source is a new name). ~7-15 s on the 2-core VM;
needs g++ and Python's headers (``setup.sh`` builds it). Concurrent processes wait for one
build (torch's file lock); later ones load the library file directly (``_load``). When the
build fails, the torch path keeps its torch kernels (gather + SDPA decode, the op chains)
and says why once in the log.

``PAGODA_CPU_KERNELS``: ``auto`` (default: native where it builds), ``native`` (a build
failure is an error), ``torch`` (never: the gather + SDPA path). ``PAGODA_KERNELS=torch``
(the references everywhere, ``pagoda.kernels``) turns them off too. Both are read once
(``reload_choice``, which ``kernels.reload_settings`` calls), not per call.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import time
from pathlib import Path
from typing import Optional

import torch

logger = logging.getLogger(__name__)

KERNELS_ENV = "PAGODA_CPU_KERNELS"
_CHOICES = ("auto", "native", "torch")
_SOURCES = [Path(__file__).with_name("csrc") / name
            for name in ("cpu_attention.cpp", "cpu_prefill_attention.cpp", "cpu_elementwise.cpp", "cpu_gemm.cpp",
                         "cpu_amx.cpp", "cpu_int8.cpp", "cpu_threads.cpp")]
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]

_state: dict = {}  # "ops": the loaded torch.ops namespace, or "reason": why there is none
_env: dict = {}  # the two variables as last read (``reload_choice``): read once, not per call


def reload_choice() -> None:
    """Read ``PAGODA_CPU_KERNELS`` and ``PAGODA_KERNELS`` again (``kernels.reload_settings`` calls it)."""
    _env["choice"] = os.environ.get(KERNELS_ENV, "auto")
    _env["kernels"] = os.environ.get("PAGODA_KERNELS")


def _choice() -> str:
    if not _env:
        reload_choice()
    choice = _env["choice"]
    if choice not in _CHOICES:
        raise ValueError(f"{KERNELS_ENV}={choice!r}: must be one of {', '.join(_CHOICES)}")
    return "torch" if _env["kernels"] == "torch" else choice  # the references, everywhere


def _build_name() -> str:
    """``pagoda_cpu_`` and a short hash of the sources, the flags, torch's version and this
    CPU's model name and flags (the build is ``-march=native``): a name is built once."""
    try:
        with open("/proc/cpuinfo") as info:
            lines = [line for line in info if line.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = [platform.processor()]
    digest = hashlib.sha1("".join(lines + _FLAGS + [torch.__version__]).encode())
    for path in sorted(_SOURCES + list(_SOURCES[0].parent.glob("*.h"))):
        digest.update(path.read_bytes())
    return f"pagoda_cpu_{digest.hexdigest()[:12]}"


def _load(name: str) -> None:
    """Load the build called ``name``: straight from its file when it is there (no lock, so
    a process killed meanwhile cannot leave one behind), else build it (torch's lock file
    makes concurrent builders wait; one left by a builder killed over 5 minutes ago is
    removed first)."""
    from torch.utils import cpp_extension

    directory = Path(cpp_extension._get_build_directory(name, verbose=False))
    library, lock = directory / f"{name}.so", directory / "lock"
    if library.exists() and not lock.exists():  # built, and no build under way
        torch.ops.load_library(str(library))
        return
    if lock.exists() and time.time() - lock.stat().st_mtime > 300:
        lock.unlink(missing_ok=True)
    _ninja_on_path()
    cpp_extension.load(name, [str(p) for p in _SOURCES], extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"],
                       is_python_module=False, verbose=False, build_directory=str(directory))


def _ninja_on_path() -> None:
    """torch runs ``ninja`` from PATH; the pip package's binary is not there outside an
    activated venv (a test run, tritonserver's stub): put it there."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"


def build() -> Optional[str]:
    """Build (or load the cached build of) the kernels; ``None`` when loaded, else why not."""
    if "ops" in _state or "reason" in _state:
        return _state.get("reason")
    try:
        _load(_build_name())
        _state["ops"] = torch.ops.pagoda_cpu
    except Exception as exc:  # noqa: BLE001 - any build failure falls back, with its reason
        _state["reason"] = f"the C++ kernels did not build: {type(exc).__name__}: {str(exc).strip()[-300:]}"
    return _state.get("reason")


def loaded_ops():
    """``torch.ops.pagoda_cpu`` when pagoda's C++ kernels are to be used, else ``None``
    (``PAGODA_CPU_KERNELS=torch``, or the build failed: logged once)."""
    choice = _choice()
    if choice == "torch":
        return None
    reason = build()
    if reason is not None:
        if choice == "native":
            raise RuntimeError(f"{KERNELS_ENV}=native: {reason}")
        if not _state.get("logged"):
            _state["logged"] = True
            logger.warning("CPU kernels: torch's (%s)", reason)
        return None
    return _state["ops"]


def gemm_features() -> frozenset:
    """What the C++ matmul runs on this machine (``cpu_gemm.cpp``'s ``gemm_features``):
    ``avx512f`` (float32 vector tiles), ``avx512bf16`` (bfloat16 vector tiles), ``amx``;
    empty without them (the plain C++ tiles) or without the C++ kernels. Asked once."""
    if "features" not in _state:
        ops = loaded_ops()
        _state["features"] = frozenset(ops.gemm_features().split(",")) - {""} if ops is not None else frozenset()
    return _state["features"]


def bind_threads(cpus: list[int]) -> list[int]:
    """Bind torch's threads of the calling thread's team to ``cpus``, thread t to ``cpus[t]``
    (``csrc/cpu_threads.cpp``; torch's thread count becomes ``len(cpus)``).

    Returns:
        the CPU each thread runs on once bound (equal to ``cpus``).
    Raises:
        RuntimeError: without pagoda's C++ kernels (naming why), or when a CPU cannot be bound.
    """
    ops = loaded_ops()
    if ops is None:
        raise RuntimeError(f"cpu_threads_bind needs pagoda's C++ CPU kernels: {build() or KERNELS_ENV + '=torch'}")
    return list(ops.bind_threads(list(cpus)))


def native_ops(x: torch.Tensor):
    """``torch.ops.pagoda_cpu`` for an op on ``x`` (a CPU float32/bfloat16 tensor, the
    kernels available), else ``None``."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    return loaded_ops()


def native_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor):
    """The ops to run this call's decode rows with (``decode_attention``), or ``None``: the C++
    kernel reads a contiguous CPU float32/bfloat16 cache with queries of its dtype."""
    if k_cache.dtype != q.dtype or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return None
    return native_ops(q)


PREFILL_HEAD_SIZES = (32, 64, 80, 96, 128)  # csrc/cpu_prefill_attention.cpp's


def native_prefill(decode_ops, head_size: int):
    """The ops to run this call's prompt chunks with (``prefill_attention``), or ``None``:
    ``decode_ops`` is ``native_decode``'s answer for the call (the same cache conditions), and
    the build has AVX-512 and the head size is one the kernel has."""
    if decode_ops is None or head_size not in PREFILL_HEAD_SIZES or "avx512f" not in gemm_features():
        return None
    return decode_ops


if __name__ == "__main__":  # setup.sh: build now, so the first request does not wait for it
    logging.basicConfig(level=logging.INFO)
    why = build()
    print("pagoda CPU kernels:", "built" if why is None else why)
