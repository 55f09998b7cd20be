"""How many tokens to draft for a request this step: fixed, or adapted to acceptance and load.

``AdaptiveWindow`` picks ``k`` in ``0..max_k`` maximizing expected tokens per unit of step
time, from a per-request acceptance estimate ``a`` (an EWMA, see ``AcceptanceEstimate``)
and the step's load:

* expected tokens from one verification with window ``k`` (i.i.d. acceptance ``a``):
  ``1 + a + a^2 + ... + a^k``;
* relative step cost: the target pass grows with the number of tokens it computes,
  ``(1 + (T0 + S*k) / T_sat) / (1 + T0 / T_sat)`` where ``T0`` is the step's tokens
  without speculation, ``S`` the number of requests that may speculate, and ``T_sat``
  the token count at which a pass's compute equals its fixed cost (weights streamed from
  memory, launches): small on a CPU, hundreds on a GPU. Plus ``k`` draft passes, each
  costing ``draft_cost`` of a target pass.

So ``k`` shrinks as acceptance falls or as the batch grows (a busy pass is compute-bound
and every drafted token costs real time), and ``k = 0`` turns speculation off for that
request and step. A request whose estimate keeps it at 0 is re-probed with ``k = 1``
after ``probe_interval`` steps (when ``k = 1`` could pay off at all), so a request whose
text turns repetitive later is noticed; the interval doubles after every probe (up to
``max_probe_interval``) until the window opens again by itself, because a probe of a
draft model that has sat idle costs a catch-up pass over everything since.
"""

from __future__ import annotations

from dataclasses import dataclass

# Target-pass saturation (tokens) per device type; see the module docstring.
SATURATION_TOKENS = {"cpu": 16, "cuda": 256}


@dataclass
class AcceptanceEstimate:
    """EWMA of the per-token acceptance probability.

    Each verification observes ``num_accepted`` accepted drafts followed, unless all were
    accepted, by one rejection; each is one Bernoulli trial folded into the average.
    """

    value: float
    weight: float = 0.2
    num_zero_steps: int = 0  # consecutive steps the window chose k = 0
    probe_after: int = 0  # steps at k = 0 before the next probe (0: the window's base interval)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        outcomes = [1.0] * num_accepted + ([0.0] if num_accepted < num_drafted else [])
        for outcome in outcomes:
            self.value += self.weight * (outcome - self.value)


class FixedWindow:
    """Always ``max_k`` (for comparison, and for workloads known to accept well)."""

    def __init__(self, max_k: int) -> None:
        self.max_k = max_k

    def choose(self, estimate: AcceptanceEstimate, num_step_tokens: int, num_speculating: int) -> int:
        return self.max_k


class AdaptiveWindow:
    """Args:
    max_k: the largest window (``num_speculative_tokens``).
    draft_cost: one draft pass relative to one target pass (0 for n-gram lookup).
    saturation_tokens: ``T_sat`` of the device.
    probe_interval: steps at k = 0 before the first k = 1 probe.
    max_probe_interval: the longest interval after repeated probes.
    """

    def __init__(self, max_k: int, draft_cost: float, saturation_tokens: int, probe_interval: int = 16,
                 max_probe_interval: int = 256) -> None:
        self.max_k = max_k
        self.draft_cost = draft_cost
        self.saturation_tokens = saturation_tokens
        self.probe_interval = probe_interval
        self.max_probe_interval = max_probe_interval

    def goodput(self, acceptance: float, k: int, num_step_tokens: int, num_speculating: int) -> float:
        """Expected tokens per unit time relative to not speculating (1.0 at k = 0)."""
        expected = sum(acceptance**i for i in range(k + 1))
        sat = self.saturation_tokens
        cost = (1 + (num_step_tokens + num_speculating * k) / sat) / (1 + num_step_tokens / sat)
        return expected / (cost + self.draft_cost * k)

    def choose(self, estimate: AcceptanceEstimate, num_step_tokens: int, num_speculating: int) -> int:
        best = max(range(self.max_k + 1),
                   key=lambda k: (self.goodput(estimate.value, k, num_step_tokens, num_speculating), -k))
        if best > 0:
            estimate.num_zero_steps = estimate.probe_after = 0
            return best
        estimate.num_zero_steps += 1
        interval = estimate.probe_after or self.probe_interval
        if estimate.num_zero_steps >= interval and self.goodput(1.0, 1, num_step_tokens, num_speculating) > 1.0:
            estimate.num_zero_steps = 0
            estimate.probe_after = min(2 * interval, self.max_probe_interval)
            return 1
        return 0
