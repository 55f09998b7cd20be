"""One-off cross-check of pagoda's AWQ and GPTQ readers against AutoAWQ's own code.

AutoAWQ is not a pagoda dependency (its sdist builds CUDA extensions), so this is not a
test: unpack its sdist and point AUTOAWQ_SRC at it, then run from the repository root:

    pip download autoawq==0.2.9 --no-deps -d /tmp/q && tar xzf /tmp/q/autoawq-0.2.9.tar.gz -C /tmp
    AUTOAWQ_SRC=/tmp/autoawq-0.2.9 python examples/quant_crosscheck_autoawq.py

It packs a random weight the way tests/models/test_quant_checkpoints.py does (AWQ GEMM,
group 128), then compares (1) AutoAWQ's ``dequantize_gemm`` with pagoda's ``dequantize_awq``
(equal after rounding pagoda's float32 to AutoAWQ's float16), and (2) AutoAWQ's own repack
of the same tensors into the GPTQ/exllama layout (``unpack_reorder_pack``: packed along K,
zeros stored minus one) read by pagoda's ``dequantize_gptq`` (equal). Output on 2026-11-25:
both differences 0.0.
"""

import importlib.util
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pagoda.models.quant_checkpoint import dequantize_awq, dequantize_gptq  # noqa: E402
from tests.models.test_quant_checkpoints import awq_tensors  # noqa: E402

path = Path(os.environ["AUTOAWQ_SRC"]) / "awq" / "utils" / "packing_utils.py"
spec = importlib.util.spec_from_file_location("packing_utils", path)
packing = importlib.util.module_from_spec(spec)
spec.loader.exec_module(packing)

torch.manual_seed(0)
tensors, _ = awq_tensors(torch.randn(64, 256), 128)
theirs = packing.dequantize_gemm(tensors["qweight"], tensors["qzeros"], tensors["scales"], 4, 128)  # [K, N] fp16
ours = dequantize_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"], 128)  # [N, K] fp32
print("AWQ: AutoAWQ dequantize_gemm vs pagoda (rounded to fp16):", (theirs - ours.t().half()).abs().max().item())
qweight, qzeros = packing.unpack_reorder_pack(tensors["qweight"], tensors["qzeros"], 4)
gptq = dequantize_gptq(qweight, qzeros, tensors["scales"], None, 4, 128)
print("GPTQ: AutoAWQ's GPTQ-layout repack read by pagoda vs pagoda's AWQ read:", (gptq - ours).abs().max().item())
