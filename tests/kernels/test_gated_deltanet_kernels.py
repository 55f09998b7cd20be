"""Gated DeltaNet kernels (causal conv1d, gated delta rule, gated RMSNorm) against float64 loops.

Both implementations behind ``pagoda.kernels`` run each case: the torch one (the CPU path,
``reference_gdn``) and the OpenAI-Triton one under ``TRITON_INTERPRET=1`` (tests/conftest.py).
The references are plain per-token loops in float64, written here from the recurrences
(``S <- exp(g) S; S <- S + beta k (v - S^T k)^T; o = S^T q``; the conv's window sum), so
they share nothing with the chunked algorithm or the kernels. Bounds: tests/numerics.py's
``delta_rule_error_bound`` (path length x unit roundoff x magnitude), Higham's ``gamma_k``
for the conv's sums and the norm's mean of squares.

A step mixes single-token (decode) sequences with longer ones of lengths that do and do not
divide the chunk size, in slots out of order; the slots of sequences that start from zeros
(``has_initial_state`` false) and the slots no sequence owns hold NaN: the first must be
overwritten without ever being read, the second stay NaN. A padding row (slot -1) writes
nothing. Splitting every sequence's tokens over two steps gives what one step gives.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.kernels import reference_gdn, triton_conv1d, triton_gdn, triton_norm
from pagoda.kernels.metadata import AttentionMetadata

from tests.numerics import UNIT_ROUNDOFF, assert_within, delta_rule_error_bound, gamma

DELTA_RULE = {"torch": reference_gdn.gated_delta_rule, "triton": triton_gdn.gated_delta_rule}
CONV = {"torch": reference_gdn.causal_conv1d, "triton": triton_conv1d.causal_conv1d}
GATED_NORM = {"torch": reference_gdn.gated_rms_norm, "triton": triton_norm.gated_rms_norm}
NUM_SLOTS = 8
# (tokens this step, slot, read the slot): decode tokens beside chunks of 5, 32 (two full
# chunks of 16) and 21 (one and a bit) tokens; slots 0, 4 and 7 belong to no sequence.
STEP = ((5, 3, False), (1, 6, True), (32, 1, True), (1, 2, False), (21, 5, True))


def rounding(dtype: torch.dtype) -> float:
    """One rounding to ``dtype``, relative: a whole ulp (2u) for bf16, which the Triton
    interpreter converts to by truncation (the GPU rounds to nearest, half that)."""
    return UNIT_ROUNDOFF[dtype] * (2 if dtype == torch.bfloat16 else 1)


def make_meta(lens, slots, reads) -> AttentionMetadata:
    return AttentionMetadata.build(list(lens), [n + 40 for n in lens], [[0] * 32] * len(lens), 4,
                                   state_indices=list(slots), has_initial_state=list(reads))


def poisoned(states: torch.Tensor, step) -> torch.Tensor:
    """NaN in every slot that no sequence reads (free slots and those starting from zeros)."""
    states = states.clone()
    read = {slot for _, slot, reads in step if reads}
    for slot in range(states.shape[0]):
        if slot not in read:
            states[slot] = float("nan")
    return states


def check_untouched(after: torch.Tensor, before: torch.Tensor, step) -> None:
    owned = {slot for _, slot, _ in step}
    for slot in range(before.shape[0]):
        if slot not in owned:
            assert torch.equal(after[slot].isnan(), before[slot].isnan()), f"slot {slot} was written"
            assert torch.equal(after[slot].nan_to_num(7.0), before[slot].nan_to_num(7.0)), f"slot {slot} was written"
        else:
            assert not after[slot].isnan().any(), f"slot {slot}: NaN leaked into a sequence's state"


# ---- the gated delta rule -------------------------------------------------------------------

def loop_delta_rule(q, k, v, g, beta, state):
    """One sequence, token by token, float64: (o [L, Hv, Dv], final state [Hv, Dk, Dv])."""
    group = v.shape[1] // k.shape[1]
    q, k = q.double().repeat_interleave(group, 1), k.double().repeat_interleave(group, 1)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    state = state.double().clone()
    out = torch.empty(v.shape, dtype=torch.float64)
    for t in range(v.shape[0]):
        state = state * g[t].double().exp()[:, None, None]
        delta = (v[t].double() - torch.einsum("hkv,hk->hv", state, k[t])) * beta[t].double()[:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hkv,hk->hv", state, q[t])
    return out, state


def delta_inputs(num_tokens: int, heads=(2, 4), dims=(16, 16), dtype=torch.float32, seed=0):
    (hk, hv), (dk, dv) = heads, dims
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, hk, dk, generator=gen).to(dtype)
    k = torch.randn(num_tokens, hk, dk, generator=gen).to(dtype)
    v = torch.randn(num_tokens, hv, dv, generator=gen).to(dtype)
    g = -F.softplus(torch.randn(num_tokens, hv, generator=gen)) * 0.5  # float32 log decays in (-inf, 0)
    beta = torch.sigmoid(torch.randn(num_tokens, hv, generator=gen)).to(dtype)
    states = torch.randn(NUM_SLOTS, hv, dk, dv, generator=gen)
    return q, k, v, g, beta, states


def check_delta_rule(impl, step, chunk, dtype=torch.float32):
    lens = [n for n, _, _ in step]
    q, k, v, g, beta, states = delta_inputs(sum(lens), dtype=dtype)
    before = poisoned(states, step)
    after = before.clone()
    out = DELTA_RULE[impl](q, k, v, g, beta, after, make_meta(lens, [s for _, s, _ in step],
                                                                [r for _, _, r in step]), chunk)
    check_untouched(after, before, step)
    start = 0
    for n, slot, reads in step:
        rows = slice(start, start + n)
        start += n
        initial = states[slot] if reads else torch.zeros_like(states[slot])
        ref_out, ref_state = loop_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows], initial)
        scale = max(float(ref_state.abs().max()), float(initial.abs().max()), float(v.abs().max()))
        bound = delta_rule_error_bound(n, chunk, q.shape[-1], v.shape[-1], scale)
        assert bound < 1e-3 * scale, "the bound must stay far below what a wrong read or decay does"
        out_bound = bound + rounding(dtype) * ref_out.abs()  # the output's rounding to its dtype
        assert_within(out[rows], ref_out, out_bound, f"{impl} chunk {chunk}: output of a {n}-token sequence")
        assert_within(after[slot], ref_state, bound, f"{impl} chunk {chunk}: state of a {n}-token sequence")


@pytest.mark.parametrize("chunk", [4, 16, 64])
def test_torch_delta_rule_equals_the_float64_loop(chunk):
    check_delta_rule("torch", STEP, chunk)


@pytest.mark.parametrize("chunk", [16, 32])
def test_triton_delta_rule_equals_the_float64_loop(chunk):
    check_delta_rule("triton", STEP, chunk)


def test_triton_delta_rule_in_bfloat16():
    check_delta_rule("triton", STEP[:3], 16, dtype=torch.bfloat16)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_delta_rule_state_carries_across_steps(impl):
    """Each sequence's tokens over two steps (the state through its slot) == one step."""
    lens, slots, reads = [n for n, _, _ in STEP], [s for _, s, _ in STEP], [r for _, _, r in STEP]
    q, k, v, g, beta, states = delta_inputs(sum(lens))
    starts = [0] + torch.tensor(lens).cumsum(0).tolist()
    firsts = [n // 2 if n > 1 else 1 for n in lens]  # 5 -> 2 + 3, 32 -> 16 + 16, 21 -> 10 + 11
    later = [i for i, n in enumerate(lens) if n > firsts[i]]
    rows_a = torch.cat([torch.arange(starts[i], starts[i] + firsts[i]) for i in range(len(lens))])
    rows_b = torch.cat([torch.arange(starts[i] + firsts[i], starts[i + 1]) for i in later])

    def run(rows, step_lens, step_slots, step_reads, states):
        return DELTA_RULE[impl](q[rows], k[rows], v[rows], g[rows], beta[rows], states,
                                make_meta(step_lens, step_slots, step_reads), 16)

    whole = poisoned(states, STEP)
    out_whole = run(torch.arange(sum(lens)), lens, slots, reads, whole)
    split = poisoned(states, STEP)
    out_a = run(rows_a, firsts, slots, reads, split)
    out_b = run(rows_b, [lens[i] - firsts[i] for i in later], [slots[i] for i in later], [True] * len(later), split)
    scale = max(float(whole.nan_to_num(0).abs().max()), float(states.abs().max()), float(v.abs().max()))
    bound = 2 * delta_rule_error_bound(max(lens), 16, 16, 16, scale)  # both within a bound of the exact values
    assert_within(out_a, out_whole[rows_a], bound, f"{impl}: first steps")
    assert_within(out_b, out_whole[rows_b], bound, f"{impl}: second steps")
    for slot in slots:
        assert_within(split[slot], whole[slot], bound, f"{impl}: slot {slot} after two steps")


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_a_padding_row_reads_and_writes_no_state(impl):
    step = ((3, 1, True), (1, -1, True), (2, 2, False))
    q, k, v, g, beta, states = delta_inputs(6)
    before = poisoned(states, [s for s in step if s[1] >= 0])
    after = before.clone()
    out = DELTA_RULE[impl](q, k, v, g, beta, after, make_meta([3, 1, 2], [1, -1, 2], [True, True, False]), 16)
    check_untouched(after, before, [s for s in step if s[1] >= 0])
    ref, _ = loop_delta_rule(q[4:], k[4:], v[4:], g[4:], beta[4:], torch.zeros_like(states[0]))
    assert_within(out[4:], ref, delta_rule_error_bound(2, 16, 16, 16, 10.0), f"{impl}: the row after the padding")


def test_triton_refuses_a_chunk_size_it_cannot_tile():
    q, k, v, g, beta, states = delta_inputs(3)
    with pytest.raises(ValueError, match="chunk_size"):
        triton_gdn.gated_delta_rule(q, k, v, g, beta, states, make_meta([3], [0], [False]), 24)


# ---- the causal conv1d -----------------------------------------------------------------------

def loop_conv(x, weight, bias, state):
    """One sequence in float64: (silu(conv) [L, C], new state [C, K - 1])."""
    stream = torch.cat([state.double(), x.double().T], dim=1)  # [C, K - 1 + L]
    width = weight.shape[1]
    out = torch.empty(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        acc = (stream[:, t:t + width] * weight.double()).sum(-1) + (0 if bias is None else bias.double())
        out[t] = F.silu(acc)
    return out, stream[:, -(width - 1):]


def check_conv(impl, step, dtype=torch.float32, kernel_size=4, with_bias=True, seed=1):
    lens = [n for n, _, _ in step]
    gen = torch.Generator().manual_seed(seed)
    channels = 24
    wide = torch.randn(sum(lens), channels + 8, generator=gen).to(dtype)
    x = wide[:, :channels]  # a strided view, as the layer passes its projection's columns
    weight = torch.randn(channels, kernel_size, generator=gen).to(dtype)
    bias = torch.randn(channels, generator=gen).to(dtype) if with_bias else None
    states = torch.randn(NUM_SLOTS, channels, kernel_size - 1, generator=gen).to(dtype)
    before = poisoned(states, step)
    after = before.clone()
    out = CONV[impl](x, weight, bias, after, make_meta(lens, [s for _, s, _ in step], [r for _, _, r in step]))
    check_untouched(after, before, step)
    start = 0
    for n, slot, reads in step:
        rows = slice(start, start + n)
        start += n
        initial = states[slot] if reads else torch.zeros_like(states[slot])
        ref, ref_state = loop_conv(x[rows], weight, bias, initial)
        stream = torch.cat([initial.double(), x[rows].double().T], dim=1)
        magnitude = torch.stack([(stream[:, t:t + kernel_size].abs() * weight.double().abs()).sum(-1)
                                 for t in range(n)]) + (0 if bias is None else bias.double().abs())
        # float32 sum of K + 1 terms, silu (Lipschitz 1.1, a few roundings), one rounding to dtype
        bound = 1.1 * gamma(kernel_size + 1, torch.float32) * magnitude + (4 * UNIT_ROUNDOFF[torch.float32]
                                                                              + rounding(dtype)) * ref.abs()
        assert_within(out[rows], ref, bound, f"{impl}: conv of a {n}-token sequence")
        assert torch.equal(after[slot].double(), ref_state), f"{impl}: the conv state holds the last inputs"


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_equals_the_float64_loop(impl, dtype):
    check_conv(impl, STEP, dtype)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_conv_decode_only_step_takes_the_update_form(impl):
    check_conv(impl, ((1, 3, True), (1, 0, False), (1, 6, True)), with_bias=False)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("kernel_size", [2, 3])
def test_conv_other_kernel_sizes_and_sequences_shorter_than_the_state(impl, kernel_size):
    check_conv(impl, ((1, 3, True), (2, 1, True), (1, 5, False), (7, 2, False)), kernel_size=kernel_size)


def test_conv_refuses_a_state_of_the_wrong_width():
    x, weight = torch.randn(2, 8), torch.randn(8, 4)
    with pytest.raises(ValueError, match="conv_states"):
        triton_conv1d.causal_conv1d(x, weight, None, torch.zeros(2, 8, 2), make_meta([2], [0], [False]))


# ---- the gated RMSNorm -----------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_equals_the_float64_formula(impl, dtype):
    gen = torch.Generator().manual_seed(2)
    x = (3 * torch.randn(19, 24, generator=gen)).to(dtype)
    gate = torch.randn(19, 24, generator=gen).to(dtype)
    weight = torch.randn(24, generator=gen).to(dtype)
    out = GATED_NORM[impl](x, gate, weight, 1e-6)
    xd = x.double()
    ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double() * F.silu(gate.double())
    # mean of squares (gamma_24), rsqrt and silu (a few roundings), and three roundings to dtype
    relative = gamma(24, torch.float32) + 8 * UNIT_ROUNDOFF[torch.float32] + 3 * rounding(dtype)
    assert_within(out, ref, 2 * relative * ref.abs() + 1e-30, f"{impl} gated norm in {dtype}")


# ---- no host reads -------------------------------------------------------------------------

class RecordedLaunch:
    """Stands in for a Triton kernel: records ``kernel[grid](*args, **kwargs)``."""

    def __init__(self, launches: list):
        self.launches = launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


def test_triton_wrappers_read_nothing_back_from_the_device(monkeypatch):
    """On meta tensors (no data: any ``.item()``, ``.tolist()`` or data-dependent shape raises)
    the wrappers choose and launch their kernels from host values only, as a CUDA step needs."""
    launches: list = []
    for module, names in ((triton_gdn, ("_gdn_chunk_kernel", "_gdn_recurrent_kernel")),
                          (triton_conv1d, ("_conv1d_kernel", "_conv1d_update_kernel")),
                          (triton_norm, ("_gated_rms_norm_kernel",))):
        for name in names:
            monkeypatch.setattr(module, name, RecordedLaunch(launches))
    meta = "meta"
    for lens in ([1, 1, 1], [5, 1, 9]):  # decode-only (recurrent + update form), mixed (both kernels)
        step = AttentionMetadata.build(lens, lens, [[0] * 4] * 3, 4, device=meta, state_indices=[0, 1, 2])
        tokens = sum(lens)
        q, v = torch.empty(tokens, 2, 16, device=meta), torch.empty(tokens, 4, 16, device=meta)
        out = triton_gdn.gated_delta_rule(q, q, v, torch.empty(tokens, 4, device=meta),
                                          torch.empty(tokens, 4, device=meta),
                                          torch.empty(4, 4, 16, 16, device=meta), step, 16)
        conv = triton_conv1d.causal_conv1d(torch.empty(tokens, 48, device=meta), torch.empty(48, 4, device=meta),
                                           None, torch.empty(4, 48, 3, device=meta), step)
        normed = triton_norm.gated_rms_norm(v.view(-1, 16), v.view(-1, 16), torch.empty(16, device=meta), 1e-6)
        assert out.shape == v.shape and conv.shape == (tokens, 48) and normed.shape == (tokens * 4, 16)
    assert len(launches) == 3 + 4  # decode: recurrent, update conv, norm; mixed: both rules, conv, norm
