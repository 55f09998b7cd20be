"""``pagoda bench kernels`` on a CPU: it refuses cleanly, and its data builders and SDPA
reference agree with the torch kernel reference (the GPU-only parts are timing)."""

from __future__ import annotations

import pytest
import torch

from pagoda.bench import kernels as bench
from pagoda.kernels import reference


def test_refuses_without_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert bench.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_cli_routes_to_the_bench(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    from pagoda.cli import main

    assert main(["bench", "kernels"]) == 2


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_sdpa_reference_matches_paged_reference(dtype):
    args = bench.parse_args(["--dtype", dtype, "--num-heads", "8", "--num-kv-heads", "2", "--head-dim", "64"])
    data = bench.make_paged_data([1, 5, 1], [40, 5, 17], args, "cpu")
    expected = reference.paged_attention_ref(
        data.q.double(), data.k_cache.double(), data.v_cache.double(), data.meta, 0.125
    )
    actual = bench.sdpa_reference(data, 0.125)
    torch.testing.assert_close(actual.double(), expected, atol=3e-2, rtol=3e-2)


def test_contiguous_kv_layout():
    args = bench.parse_args(["--num-heads", "4", "--num-kv-heads", "2", "--head-dim", "64", "--block-size", "4"])
    data = bench.make_paged_data([3], [10], args, "cpu")
    k, v = bench.contiguous_kv(data, 0, 4)
    assert k.shape == (1, 4, 10, 64) and k.is_contiguous()
    table = data.meta.block_tables[0]
    assert torch.equal(k[0, 3, 9], data.k_cache[table[2], 1, 1])  # position 9, query head 3 -> KV head 1
    assert torch.equal(v[0, 0, 4], data.v_cache[table[1], 0, 0])
