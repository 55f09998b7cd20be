"""The EAGLE-3 head pass stays on the device: a guard that runs on any CPU.

The target and its head are loaded on the ``meta`` device (shapes, no data), and
``DeviceGuard`` (``test_sampler_device.py``) watches every aten op of the proposer's two
moments: ``observe`` (the head KV of a step's verified positions, from the target's
auxiliary hidden states) must read nothing back, and ``propose`` (three chained draft
tokens for a greedy and a seeded request) may read back only the drafted token ids, one
``[requests]`` read per draft step; no host op may touch a hidden- or vocabulary-sized
tensor. The paged-attention kernel is replaced by a shape-only stand-in: on a GPU it is an
OpenAI-Triton kernel that reads its metadata on the device, while its CPU reference walks
the sequences on the host. A second test copies the auxiliary states through the host
and checks that the guard catches it.
"""

from __future__ import annotations

import pytest
import torch

from pagoda import kernels
from pagoda.engine.request import Request
from pagoda.engine.sampling.row import SamplingRow
from pagoda.engine.sampling.sampler import Sampler
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.spec_decode.draft import DraftRequest
from pagoda.engine.spec_decode.eagle3 import load_eagle3_head
from pagoda.engine.spec_decode.hidden_proposer import HeadEntry, HiddenStateProposer
from pagoda.engine.spec_decode.random_heads import write_random_eagle3_head
from pagoda.models.loader import load_model

from tests.engine.test_sampler_device import DeviceGuard
from tests.engine.test_spec_engine import make_small_model

META = torch.device("meta")
NUM_DRAFTS = 3


@pytest.fixture(scope="module")
def paths(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("head_device")
    target = make_small_model(root / "target", smollm2_path, seed=0)
    return target, str(write_random_eagle3_head(root / "head", target, seed=3))


def _proposer(paths, monkeypatch):
    monkeypatch.setattr(kernels, "paged_attention", lambda q, *args, **kwargs: torch.empty_like(q))
    target = load_model(paths[0], dtype=torch.float32, device=META)
    head = load_eagle3_head(paths[1], target, 256, torch.float32, META)
    return HiddenStateProposer(head, target, 16, 16, Sampler(target.config.vocab_size)), target


def _observe_and_propose(proposer, target):
    """One target step's head pass (requests ``a``: 5 verified positions, ``b``: 3), then
    the next step's drafts; returns the guards of both moments."""
    hidden_size = target.config.hidden_size
    hidden = torch.empty(8, hidden_size, device=META)  # the step's final hidden states
    target.aux_hidden = torch.empty(8, 3 * hidden_size, device=META)  # what its forward keeps for the head
    with DeviceGuard(hidden_size) as observed:
        proposer.observe([HeadEntry("a", 0, 0, [5, 6, 7, 8, 9]), HeadEntry("b", 0, 5, [11, 12, 13])], hidden)
    requests = [Request("a", [1, 2, 3, 4, 5, 6], SamplingParams(temperature=0)),
                Request("b", [1, 2, 3, 4], SamplingParams(temperature=0.8, seed=3))]
    batch = [DraftRequest(r, NUM_DRAFTS, SamplingRow(r.sampling_params, r.sampling_params.seed, r.prompt_token_ids))
             for r in requests]
    with DeviceGuard(hidden_size) as proposed:
        drafts = proposer.propose(batch)
    assert {rid: len(d.token_ids) for rid, d in drafts.items()} == {"a": NUM_DRAFTS, "b": NUM_DRAFTS}
    return observed, proposed


def test_eagle3_head_reads_aux_states_on_the_device_and_returns_only_draft_ids(paths, monkeypatch):
    observed, proposed = _observe_and_propose(*_proposer(paths, monkeypatch))
    for guard in (observed, proposed):
        assert guard.host_ops == [], "hidden- or vocabulary-sized work on the host:\n" + "\n".join(guard.host_ops)
    assert observed.reads == [], f"observe read from the device: {observed.read_shapes}"
    assert proposed.read_shapes == [(2,)] * NUM_DRAFTS, "only the drafted ids, one [requests] read per draft step"


def test_guard_catches_aux_states_copied_through_the_host(paths, monkeypatch):
    proposer, target = _proposer(paths, monkeypatch)
    reads_aux = proposer.head.target_features
    monkeypatch.setattr(proposer.head, "target_features", lambda t, h: reads_aux(t, h).cpu().to(h.device))
    observed, _ = _observe_and_propose(proposer, target)
    assert (8, 3 * target.config.hidden_size) in observed.read_shapes, observed.read_shapes
