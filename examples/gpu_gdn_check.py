"""The Gated DeltaNet kernels' float64 checks (tests/kernels/test_gated_deltanet_kernels.py) run
on a GPU: the same inputs, bounds and NaN-poisoned slots, with the Triton kernel compiled for
the device instead of interpreted. Usage, from the repository root on a CUDA machine:
``PYTHONPATH=backend python3 examples/gpu_gdn_check.py``; prints one line per check."""

import sys
import time

import torch

sys.path.insert(0, ".")

import tests.kernels.test_gated_deltanet_kernels as cases  # noqa: E402
from pagoda.kernels import triton_gdn  # noqa: E402
from pagoda.kernels.metadata import AttentionMetadata  # noqa: E402


def cuda_meta(lens, slots, reads):
    return AttentionMetadata.build(list(lens), [n + 40 for n in lens], [[0] * 32] * len(lens), 4, device="cuda",
                                   state_indices=list(slots), has_initial_state=list(reads))


def cuda_rule(q, k, v, g, beta, states, meta, chunk):
    moved = [t.cuda() for t in (q, k, v, g, beta)]
    device_states = states.cuda()
    out = triton_gdn.gated_delta_rule(*moved, device_states, meta, chunk)
    torch.cuda.synchronize()
    states.copy_(device_states.cpu())  # the kernel updates its states in place
    return out.cpu()


cases.make_meta = cuda_meta
cases.DELTA_RULE["triton"] = cuda_rule
checks = [("chunk 16, fp32", lambda: cases.check_delta_rule("triton", cases.STEP, 16)),
          ("chunk 32, fp32", lambda: cases.check_delta_rule("triton", cases.STEP, 32)),
          ("chunk 64, fp32", lambda: cases.check_delta_rule("triton", cases.STEP, 64)),
          ("chunk 16, bf16", lambda: cases.check_delta_rule("triton", cases.STEP[:3], 16, dtype=torch.bfloat16)),
          ("state across two steps", lambda: cases.test_delta_rule_state_carries_across_steps("triton"))]
failed = 0
for name, check in checks:
    start = time.perf_counter()
    try:
        check()
        print(f"ok    {name} ({time.perf_counter() - start:.1f} s)")
    except AssertionError as exc:
        failed += 1
        print(f"FAIL  {name}: {str(exc)[:400]}")
print(f"{len(checks) - failed} of {len(checks)} gated-delta-rule checks within their float64 bounds on "
      f"{torch.cuda.get_device_name()}")
