"""The dispatch point picks the Triton kernels or the torch references as documented."""

from __future__ import annotations

import sys

import torch

from pagoda import kernels


def test_cpu_tensors_use_references_by_default(monkeypatch):
    monkeypatch.delenv("PAGODA_KERNELS", raising=False)
    kernels.reload_settings()
    assert not kernels.use_triton(torch.zeros(1))


def test_env_override(monkeypatch):
    monkeypatch.setenv("PAGODA_KERNELS", "triton")
    kernels.reload_settings()
    assert kernels.use_triton(torch.zeros(1))
    monkeypatch.setenv("PAGODA_KERNELS", "torch")
    kernels.reload_settings()
    assert not kernels.use_triton(torch.zeros(1))


def test_the_choice_is_read_once_not_per_call(monkeypatch):
    """A change of the environment takes effect at ``reload_settings`` (the model runner calls
    it when an engine is built), not at the next kernel call."""
    monkeypatch.setenv("PAGODA_KERNELS", "triton")
    kernels.reload_settings()
    monkeypatch.setenv("PAGODA_KERNELS", "torch")
    assert kernels.use_triton(torch.zeros(1))  # still the choice read last
    kernels.reload_settings()
    assert not kernels.use_triton(torch.zeros(1))


def test_missing_triton_falls_back_to_references(monkeypatch):
    monkeypatch.setenv("PAGODA_KERNELS", "triton")
    kernels.reload_settings()
    for name in [m for m in sys.modules if m == "triton" or m.startswith(("triton.", "pagoda.kernels.triton"))]:
        monkeypatch.delitem(sys.modules, name)
        if name.startswith("pagoda.kernels."):  # `from pagoda.kernels import x` reads the attribute first
            monkeypatch.delattr(kernels, name.rsplit(".", 1)[1], raising=False)
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    assert not kernels.use_triton(torch.zeros(1))
    x = torch.randn(2, 8)
    out, _ = kernels.rms_norm(x, torch.ones(8), 1e-6)
    torch.testing.assert_close(out, kernels.reference.rms_norm(x, torch.ones(8), 1e-6)[0])
