"""Beam search's bookkeeping on the scheduler, with fake runner outputs (no model, no torch).

One group, width 2, traced step by step with exact states: which beam continues, which is
forked (its table shares the parent's full blocks and gets a copy of the partial one),
which is pruned (only what it alone held is freed), the plans the runner receives, the
finished hypotheses and their scores, and an empty pool at the end.
"""

from __future__ import annotations

from pagoda.engine.request_groups.beam_search import BeamSearch
from pagoda.engine.core.sched.scheduler import Scheduler, SchedulerConfig
from pagoda.engine.request import Request
from pagoda.engine.runner.runner_output import ModelRunnerOutput
from pagoda.engine.sampling.row import TokenLogprobs
from pagoda.engine.sampling_params import SamplingParams

EOS = 2


def _step(scheduler, beams, tops):
    """Schedule; the fake runner reports ``tops[id]`` (token, logprob pairs, best first) for
    each sampling beam; apply; let the groups choose. Returns (plan, done groups)."""
    output = scheduler.schedule()
    ids = [s.request_id for s in output.scheduled if s.is_sampling]
    logprobs = [[TokenLogprobs(tops[i][0][0], tops[i][0][1], 1, tops[i])] for i in ids]
    runner_output = ModelRunnerOutput(ids, [[tops[i][0][0]] for i in ids], logprobs, output.step_id)
    assert scheduler.update_from_output(runner_output) == []  # beams get no token from the scheduler
    return output, beams.advance(runner_output.logprobs_by_id())


def test_a_group_forks_prunes_and_finishes_on_shared_blocks():
    scheduler = Scheduler(SchedulerConfig(num_blocks=17, max_model_len=64, block_size=4, max_num_seqs=8,
                                          max_num_batched_tokens=64))
    beams = BeamSearch(scheduler)
    params = SamplingParams(use_beam_search=True, beam_width=2, n=2, temperature=0.0, max_tokens=3)
    first = beams.make_first_beam(Request("r#0", list(range(100, 106)), params, eos_token_ids=frozenset({EOS})),
                                  "r", frozenset({EOS}))
    beams.check(first)
    scheduler.add_request(first)
    beams.add(first)
    manager, pool = scheduler.kv_cache_manager, scheduler.block_pool
    assert first.beam_group.worst_case_blocks == 2 + 2 * (1 + 1)

    # Step 1: the prompt (6 tokens: one full block, one partial). 10 and 11 become the beams.
    output, done = _step(scheduler, beams, {"r#0": [(10, -0.1), (11, -0.5), (12, -2.0), (13, -3.0)]})
    assert [(s.request_id, s.num_new_tokens) for s in output.scheduled] == [("r#0", 6)] and not done
    full, partial = manager.get_block_ids("r#0")
    fork = scheduler.get_request("r@beam1")
    assert (first.output_token_ids, fork.output_token_ids) == ([10], [11])
    copy = manager.get_block_ids("r@beam1")[1]
    assert manager.get_block_ids("r@beam1") == [full, copy] and copy not in (full, partial)
    assert pool.blocks[full].ref_cnt == 2 and fork.num_computed_tokens == 6
    # A report that lands after its group chose (a step still running under async scheduling)
    # is stale: the beam's new token is not computed yet, so it counts for nothing.
    stale = TokenLogprobs(10, -0.1, 1, [(10, -0.1), (11, -0.5)])
    assert beams.advance({"r#0": [stale]}) == [] and first.beam_group.pending == {}

    # Step 2: both decode; the fork arrives as new with its whole table, its partial block copied
    # first; each beam's chosen token travels (the runner did not sample it).
    output, done = _step(scheduler, beams, {"r#0": [(EOS, -0.2), (20, -1.0), (21, -4.0), (22, -4.0)],
                                            "r@beam1": [(21, -0.1), (22, -0.2), (23, -3.0), (24, -3.0)]})
    assert output.blocks_to_copy == [(partial, copy)] and not done
    assert [(s.request_id, s.token_ids, s.is_new, s.new_block_ids[0]) for s in output.scheduled] == \
        [("r#0", [10], False, []), ("r@beam1", [11], True, [full, copy])]
    # Candidates: r#0+EOS -0.3 (ends: a finished hypothesis, score -0.3 / 2), beam1+21 -0.6,
    # beam1+22 -0.7, r#0+20 -1.1. Beam 1 continues with 21 and forks 22; r#0 is pruned.
    assert scheduler.get_request("r#0") is None
    second = scheduler.get_request("r@beam2")
    assert (fork.output_token_ids, second.output_token_ids) == ([11, 21], [11, 22])
    assert pool.blocks[partial].ref_cnt == 0, "the pruned beam's own partial block is freed"
    assert pool.blocks[full].ref_cnt == 2, "the shared prompt block stays, held by the two beams"

    # Step 3: length 3 = max_tokens, so every candidate ends; the best two of all finished
    # are the EOS one (-0.3 / 2) and beam 1 + 30 (-0.7 / 3), not beam 2 + 40 (-1.6 / 3).
    (_, beam1_partial), (shared, beam2_copy) = manager.get_block_ids("r@beam1"), manager.get_block_ids("r@beam2")
    assert shared == full and beam2_copy not in (full, beam1_partial)
    output, done = _step(scheduler, beams, {"r@beam1": [(30, -0.1), (31, -2.0), (32, -3.0), (33, -3.0)],
                                            "r@beam2": [(40, -0.9), (41, -2.0), (42, -3.0), (43, -3.0)]})
    assert output.finished_request_ids == ["r#0"]  # the runner drops the pruned beam's state
    assert output.blocks_to_copy == [(beam1_partial, beam2_copy)]
    ((group, best),) = done
    assert group.output_ids == ["r#0", "r#1"]
    assert [(h.token_ids, round(h.cumulative_logprob, 9), h.finish_reason) for h in best] == \
        [([10, EOS], -0.3, "stop"), ([11, 21, 30], -0.7, "length")]
    assert [round(h.score, 9) for h in best] == [-0.15, round(-0.7 / 3, 9)]
    assert not scheduler.requests and beams.num_groups == 0
    assert pool.num_free_blocks == pool.num_usable_blocks and all(b.ref_cnt == 0 for b in pool.blocks)
