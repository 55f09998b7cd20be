"""Proves, in a child process, that torch's packed int8 matmul works on this machine.

``aten._weight_int8pack_mm`` is registered for CPU on every x86 build, but its kernel is
chosen at run time by the CPU's instruction set, and on some CPUs it is broken: on an
Intel Xeon with AVX-512/AMX (torch 2.13) it segfaults for a ``[5, 136] x [200, 136]``
product and returns garbage for one row. ``_dispatch_has_kernel_for_dispatch_key`` says
the kernel exists; only running it says it works. A crash must not take the server (or
the test run) with it, so the kernel is run in a subprocess on the shapes the model will
use, at the row counts a decode step can have, and compared with a float64 reference.

Error bound (what "works" means): the reference takes the very inputs the kernel gets
(activations and scales already rounded to the 16-bit dtype), so the only errors are the
kernel's own: a float32 accumulation over ``K`` products (at most ``K * 2^-24`` of
``sum_k |x_k w_nk|``) and the rounding of the output to 16 bits (``u16`` of ``|out|``,
``u16 = 2^-8`` for bf16, ``2^-11`` for fp16). The check allows twice that sum; a broken
kernel is off by orders of magnitude (or NaN/inf), a correct one is well inside.

Run as ``python -m pagoda.models.int8_probe '<json>'`` with ``{"dtype": "bfloat16",
"shapes": [[out, in], ...], "rows": [1, 5, 16]}``: exit 0 and ``ok`` on stdout when every
case passes, exit 1 with the failing case on stdout, or die (a signal) if the kernel
crashes.
"""

from __future__ import annotations

import functools
import json
import logging
import platform
import subprocess
import sys
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 120.0
_UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    reason: str  # what was proven, or why the packed kernel is not used


def packed_error_bound(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-element bound on ``|kernel - exact|`` for the packed product (module docstring)."""
    k = x.shape[1]
    deq = qweight.double() * scale.double()[:, None]
    magnitude = x.double().abs() @ deq.abs().T  # [rows, out]: sum_k |x_k w_nk|
    exact = x.double() @ deq.T
    u16 = _UNIT_ROUNDOFF[x.dtype]
    return 2 * (k * 2.0**-24 * magnitude + u16 * exact.abs()) + 1e-30


def check_packed_kernel(dtype: torch.dtype, shapes: list[tuple[int, int]], rows: list[int]) -> str | None:
    """Run the packed kernel on each (out, in) shape and row count; ``None`` if all pass."""
    gen = torch.Generator().manual_seed(0)
    for out_features, in_features in shapes:
        qweight = torch.randint(-127, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
        scale = (torch.rand(out_features, generator=gen) * 0.01 + 1e-4).to(dtype)
        for num_rows in rows:
            x = torch.randn(num_rows, in_features, generator=gen).to(dtype)
            out = torch.ops.aten._weight_int8pack_mm(x, qweight, scale)
            exact = x.double() @ (qweight.double() * scale.double()[:, None]).T
            err = (out.double() - exact).abs()
            bound = packed_error_bound(x, qweight, scale)
            if out.shape != exact.shape or not bool(torch.all(err <= bound)):
                worst = float((err / bound).nan_to_num(float("inf")).max())
                return f"rows={num_rows} out={out_features} in={in_features}: error {worst:.3g}x the bound"
    return None


def cpu_description() -> str:
    """The CPU model and the instruction-set flags that decide torch's kernels."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    model = model or platform.processor() or platform.machine()
    wanted = sorted(f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "avx_vnni"))
    return f"{model} [{' '.join(wanted) or 'no avx2/avx512/amx'}]"


@functools.lru_cache(maxsize=None)
def probe_packed_kernel(dtype: torch.dtype, shapes: tuple[tuple[int, int], ...], rows: tuple[int, ...]) -> ProbeResult:
    """Prove the packed kernel in a subprocess (once per process and argument set).

    Returns:
        ``ProbeResult(ok=True, ...)`` only when the child ran every case within the bound;
        a crash, a timeout or a wrong result gives ``ok=False`` with the reason.
    """
    payload = json.dumps({"dtype": str(dtype).removeprefix("torch."), "shapes": [list(s) for s in shapes],
                          "rows": list(rows)})
    try:
        child = subprocess.run([sys.executable, "-m", "pagoda.models.int8_probe", payload], capture_output=True,
                               text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return ProbeResult(False, f"probe timed out after {PROBE_TIMEOUT_S:.0f} s")
    if child.returncode < 0:
        return ProbeResult(False, f"the kernel crashed the probe (signal {-child.returncode})")
    if child.returncode != 0 or child.stdout.strip() != "ok":
        detail = (child.stdout.strip() or child.stderr.strip().splitlines()[-1:] or ["no output"])
        return ProbeResult(False, f"wrong result: {detail if isinstance(detail, str) else detail[0]}")
    return ProbeResult(True, f"verified on {len(shapes)} shapes x rows {min(rows)}..{max(rows)}")


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    failure = check_packed_kernel(getattr(torch, spec["dtype"]), [tuple(s) for s in spec["shapes"]], spec["rows"])
    print("ok" if failure is None else failure)
    return 0 if failure is None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
