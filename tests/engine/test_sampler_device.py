"""The sampler stays on the logits' device: a guard that runs on any CPU.

The logits live on the ``meta`` device (shapes, no data), and a ``TorchDispatchMode``
sees every aten op the sampler issues. It fails the call if any op touches a host tensor
as large as a vocabulary row (noise or a filter computed on the host, or a vocabulary-
sized copy either way), and it counts device-to-host reads (``.tolist()``, ``.cpu()``,
``.item()``, ``bool(t)``), answering each with zeros so the call can finish. Host-to-device
copies of small per-row parameters are allowed. A beam-search step is checked the same way,
down to the size of its one read (each beam's top ``2k``, not a vocabulary row). A last test
puts a CPU generator back into the noise and checks that the guard catches it.
``DeviceGuard`` also serves other device-side guards (``test_spec_heads_device.py``).
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from pagoda.engine.guided.backend import bitmask_width
from pagoda.engine.guided.bitmask import TokenBitmask
from pagoda.engine.sampling import filters as sampling_filters
from pagoda.engine.sampling.sampler import Sampler, SamplingRow
from pagoda.engine.sampling_params import SamplingParams

VOCAB_SIZE = 4096  # larger than any per-row parameter tensor of a test batch
aten = torch.ops.aten


class DeviceGuard(TorchDispatchMode):
    """Records host compute on vocabulary-sized tensors and device-to-host reads."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.host_ops: list[str] = []
        self.reads: list[str] = []
        self.read_shapes: list[tuple[int, ...]] = []  # the device tensor each read copied

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_device = any(t.device.type != "cpu" for t in inputs)
        if func is aten._local_scalar_dense.default and on_device:
            self._read(func, args[0])
            return 0
        to_host = kwargs.get("device") == torch.device("cpu") or any(
            isinstance(a, torch.device) and a.type == "cpu" for a in args[1:])
        if func in (aten._to_copy.default, aten.to.dtype_layout, aten.to.device) and on_device and to_host:
            # (aten.to.* is what .tolist() dispatches under inference_mode)
            source = args[0]
            self._read(func, source)
            self._check_size(func, [source])
            dtype = kwargs.get("dtype") or next((a for a in args[1:] if isinstance(a, torch.dtype)), source.dtype)
            return torch.zeros(source.shape, dtype=dtype)
        if func is aten.copy_.default and args[0].device.type == "cpu" and args[1].device.type != "cpu":
            self._read(func, args[1])
            return args[0].zero_()
        out = func(*args, **kwargs)
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        self._check_size(func, inputs + outputs)
        return out

    def _read(self, func, source: torch.Tensor) -> None:
        self.reads.append(str(func))
        self.read_shapes.append(tuple(source.shape))

    def _check_size(self, func, tensors) -> None:
        if any(t.device.type == "cpu" and t.numel() >= self.vocab_size for t in tensors):
            self.host_ops.append(f"{func} {[tuple(t.shape) for t in tensors]}")


def _rows() -> list[list[SamplingRow]]:
    prompt, output = list(range(0, 40, 3)), [5, 7, 7, 9]
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=3, logprobs=2)
    return [
        [SamplingRow(SamplingParams(temperature=0))] * 4,  # greedy only
        [SamplingRow(SamplingParams(temperature=0.8, top_p=0.95))] * 3 + [SamplingRow(seeded, 3, prompt, output)],
        [SamplingRow(SamplingParams(temperature=1.0))] * 2,  # dense race
        [  # every stage at once, mixed with greedy and plain rows
            SamplingRow(SamplingParams(temperature=0, repetition_penalty=1.2, logprobs=0), None, prompt, output),
            SamplingRow(SamplingParams(temperature=0.7, top_k=50, min_p=0.05, presence_penalty=0.3), 9, prompt, output),
            SamplingRow(SamplingParams(temperature=1.2, frequency_penalty=0.5, min_tokens=8), None, prompt, output,
                        frozenset({0, 2})),
            SamplingRow(SamplingParams(temperature=0.5, top_k=20, top_p=0.9), None, prompt, output),
            SamplingRow(SamplingParams(temperature=1.0, min_p=0.1)),
        ],
    ]


def _guided_beams() -> tuple[list[SamplingRow], TokenBitmask]:
    """Two guided beams (their logprobs exclude what the grammar forbids) and a plain row."""
    beam = SamplingRow(SamplingParams(temperature=0, logprobs=4), logprobs_allowed_only=True)
    bits = torch.zeros(2, bitmask_width(VOCAB_SIZE), dtype=torch.int32)
    bits[:, :3] = -1
    return [beam, SamplingRow(SamplingParams(temperature=0.7)), beam], TokenBitmask(torch.tensor([0, 2]), bits)


def _guarded_call(rows: list[SamplingRow], bitmask: Optional[TokenBitmask] = None) -> DeviceGuard:
    sampler = Sampler(VOCAB_SIZE)
    logits = torch.empty(len(rows), VOCAB_SIZE + 64, device="meta")
    batch = sampler.make_batch(rows, bitmask)  # the step's host work, done once before the device step
    with DeviceGuard(VOCAB_SIZE) as guard:
        output = sampler(logits, batch)
    assert len(output.token_ids) == len(rows)
    return guard


@pytest.mark.parametrize("case", range(len(_rows()) + 1),
                         ids=["greedy", "top_p+seeded+logprobs", "plain", "everything", "guided_beams"])
def test_sampler_never_computes_on_the_host_and_reads_back_once(case):
    guard = _guarded_call(*_guided_beams()) if case == len(_rows()) else _guarded_call(_rows()[case])
    assert guard.host_ops == [], "vocabulary-sized work on the host:\n" + "\n".join(guard.host_ops)
    assert len(guard.reads) == 1, f"expected one device-to-host read, got {guard.reads}"


def test_a_beam_step_reads_back_only_each_beams_top_candidates():
    """Beam search on the device: one step of a batch holding two beam groups (width 4 with
    ``logprobs=3``; width 2 with ``logprobs=6 > 2k``), their rows made by ``BeamSearch`` as
    the engine makes them, beside a greedy and a random row, reads back once: every row's
    token id, and per beam row its chosen token's logprob and rank and its top
    ``max(2k, N)`` ids and values (8 here, the widest row's), never a vocabulary row."""
    from pagoda.engine.request_groups.beam_search import BeamSearch
    from pagoda.engine.request import Request

    beams = BeamSearch(scheduler=None)
    rows = []
    for width, num_top in ((4, 3), (2, 6)):
        params = SamplingParams(use_beam_search=True, beam_width=width, temperature=0.0, logprobs=num_top)
        first = beams.make_first_beam(Request(f"g{width}#0", [1, 2, 3], params), f"g{width}", frozenset({2}))
        rows += [first.sampling_state] * width  # forks copy their parent's row
    rows += [SamplingRow(SamplingParams(temperature=0)), SamplingRow(SamplingParams(temperature=0.9))]
    guard = _guarded_call(rows)
    assert guard.host_ops == [], "vocabulary-sized work on the host:\n" + "\n".join(guard.host_ops)
    num_beams, num_top = 6, 2 * 4
    assert guard.read_shapes == [(len(rows) + num_beams * (2 + 2 * num_top),)], guard.read_shapes


def test_guard_catches_noise_drawn_by_a_cpu_generator(monkeypatch):
    """The regression this guard exists for: Exp(1) noise from a host generator, copied over."""

    def host_noise(keys, vocab_size, columns=None):
        generator = torch.Generator().manual_seed(0)
        noise = torch.empty(keys.shape[0], vocab_size).exponential_(generator=generator).to(keys.device)
        return noise if columns is None else noise.gather(1, columns)

    monkeypatch.setattr(sampling_filters, "exponential_noise", host_noise)
    guard = _guarded_call(_rows()[1])
    assert any("exponential" in op for op in guard.host_ops), guard.host_ops
