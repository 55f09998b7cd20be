"""Decode CUDA graphs, the parts a CPU can check: capture sizes, which steps replay, the
static-buffer filling and padding, the frozen launch metadata, and that a padded decode
step through the Triton kernels (interpreter) gives the unpadded step's logits and cache.

Replay itself needs a GPU. ``_FakeGraph`` stands in for it with a graph's semantics (the
captured forward re-runs on the static buffers and overwrites the captured output), so
``DecodeGraphs.execute`` and the ``ModelRunner`` hook run end to end on a CPU.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from pagoda.engine.config import EngineConfig
from pagoda.engine.runner.cuda_graphs import (
    DecodeGraphs,
    DecodeInputs,
    capture_batch_sizes,
    is_graphable_step,
    padded_batch_size,
    should_use_graphs,
)
from pagoda.engine.runner.model_runner import ModelRunner, make_random_model
from pagoda.engine.runner.runner_output import ModelRunnerOutput
from pagoda.kernels import AttentionMetadata, reference, reload_settings, triton_attention
from pagoda.kernels.triton_attention import AttentionConfig
from pagoda.models.registry import config_from_dict
from tests.numerics import assert_within, gamma, model_error_bound
from pagoda.models.testing import make_kv_caches

BLOCK_SIZE = 4
RUNNER_BLOCK_SIZE = 8  # the smallest EngineConfig allows
TINY = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", vocab_size=96, hidden_size=64,
    intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    rms_norm_eps=1e-5, max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=False,
)  # fmt: skip


def item(token: int, position: int, block_ids: list[int], is_sampling: bool = True, num_new: int = 1):
    """A ScheduledRequest-like decode row: one new token at ``position``."""
    return SimpleNamespace(token_ids=[token] * num_new, num_computed_tokens=position, num_new_tokens=num_new,
                           block_ids=block_ids, is_sampling=is_sampling, spec_token_ids=[])  # fmt: skip


def test_capture_sizes_are_powers_of_two_then_the_maximum():
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert capture_batch_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    with pytest.raises(ValueError):
        capture_batch_sizes(0)
    sizes = capture_batch_sizes(48)
    assert [padded_batch_size(n, sizes) for n in (1, 2, 3, 5, 32, 33, 48)] == [1, 2, 4, 8, 32, 48, 48]
    assert padded_batch_size(49, sizes) is None


def test_only_decode_only_steps_that_fit_replay():
    decode = [item(5, 10, [1, 2, 3]), item(6, 3, [4])]
    assert is_graphable_step(decode, max_batch=2, max_context=16)
    assert not is_graphable_step([], max_batch=2, max_context=16)
    assert not is_graphable_step(decode, max_batch=1, max_context=16)  # too many sequences
    assert not is_graphable_step([item(5, 16, [1, 2, 3, 4, 5])], max_batch=2, max_context=16)  # past max context
    assert is_graphable_step([item(5, 15, [1, 2, 3, 4])], max_batch=2, max_context=16)
    mixed = decode + [item(7, 0, [5, 6], num_new=5)]
    assert not is_graphable_step(mixed, max_batch=4, max_context=16)  # a prefill chunk: eager
    spec = [item(5, 10, [1, 2, 3], num_new=3)]
    assert not is_graphable_step(spec, max_batch=4, max_context=16)  # several tokens per sequence: eager


def test_fill_writes_rows_and_pads_with_dummies():
    inputs = DecodeInputs(max_batch=8, max_context=32, block_size=BLOCK_SIZE, device="cpu")
    assert inputs.max_blocks == 8
    assert inputs.query_start_loc.tolist() == list(range(9))
    step = [item(11, 0, [7]), item(12, 5, [3, 9]), item(13, 8, [2, 4, 6, 1])]  # position 8 opens block 6
    inputs.fill(step, 4)
    assert inputs.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert inputs.positions[:4].tolist() == [0, 5, 8, 0]
    assert inputs.slot_mapping[:4].tolist() == [7 * 4 + 0, 9 * 4 + 1, 6 * 4 + 0, -1]
    assert inputs.seq_lens[:4].tolist() == [1, 6, 9, 1]
    tables = inputs.block_tables
    assert tables[0, :1].tolist() == [7]
    assert tables[1, :2].tolist() == [3, 9]
    assert tables[2, :3].tolist() == [2, 4, 6]  # only the blocks the context reaches
    assert tables[3, 0] == 0  # dummy row reads block 0
    # A smaller step afterwards refreshes every row a replay of its size reads.
    inputs.fill([item(20, 1, [5])], 2)
    assert inputs.input_ids[:2].tolist() == [20, 0]
    assert inputs.slot_mapping[:2].tolist() == [5 * 4 + 1, -1]
    assert inputs.seq_lens[:2].tolist() == [2, 1]
    assert tables[:2, 0].tolist() == [5, 0]


def test_metadata_views_the_static_buffers_with_frozen_host_values():
    inputs = DecodeInputs(max_batch=8, max_context=32, block_size=BLOCK_SIZE, device="cpu")
    meta = inputs.metadata(4)
    assert meta.num_seqs == 4 and meta.max_query_len == 1 and meta.max_seq_len == 32
    assert meta.seq_lens_host == [32] * 4 and meta.query_lens_host == [1] * 4
    for view, buffer in ((meta.slot_mapping, inputs.slot_mapping), (meta.seq_lens, inputs.seq_lens),
                         (meta.block_tables, inputs.block_tables), (meta.query_start_loc, inputs.query_start_loc)):
        assert view.data_ptr() == buffer.data_ptr()  # replays read what fill() wrote
    assert meta.block_tables.shape == (4, 8)

    # The launch shape depends only on these frozen values, never on the step's lengths.
    def pick(m):
        return triton_attention.choose_config(4, m.num_seqs, 32, 8, m.max_query_len, m.max_seq_len, 132)

    inputs.fill([item(1, 2, [1])], 4)
    first = pick(inputs.metadata(4))
    inputs.fill([item(1, 30, list(range(8)))] * 3, 4)
    assert pick(inputs.metadata(4)) == first


def test_kv_cache_groups_get_their_own_tables_slots_and_state_slots():
    """A full group, a sliding-window group and a state group (engine.kv.layout): each paged
    group's layers read their group's buffers; every layer sees the rows' state slots."""
    from pagoda.engine.kv.layout import group_layers
    from pagoda.engine.kv.specs import FullAttentionSpec, RecurrentStateSpec, SlidingWindowSpec

    full, window = FullAttentionSpec(2, 16, 4), SlidingWindowSpec(2, 16, 4, window=6)
    state = RecurrentStateSpec((8, 3), (2, 4, 4), 4, 4)
    layout = group_layers([full, window, state], BLOCK_SIZE)  # groups: 0 full, 1 sliding, 2 state
    inputs = DecodeInputs(max_batch=4, max_context=32, block_size=BLOCK_SIZE, device="cpu", layout=layout)
    row = SimpleNamespace(token_ids=[5], num_computed_tokens=9, num_new_tokens=1, block_ids=[1, 2, 3],
                          group_block_ids=([1, 2, 3], [0, 5, 6], [7]), is_sampling=True, spec_token_ids=[])
    inputs.fill([row], 2)
    meta = inputs.metadata(2)
    assert meta.for_layer(0) is meta and meta.for_layer(2) is meta
    sliding = meta.for_layer(1)
    assert sliding.slot_mapping.tolist() == [6 * 4 + 1, -1] and sliding.block_tables[0, :3].tolist() == [0, 5, 6]
    assert meta.slot_mapping.tolist() == [3 * 4 + 1, -1]  # group 0's own
    assert sliding.seq_lens.data_ptr() == meta.seq_lens.data_ptr()  # the sequences are shared
    assert sliding.slot_mapping.data_ptr() == inputs.groups.slots.data_ptr()  # replays read what fill() wrote
    assert meta.state_indices.tolist() == [7, -1] and meta.has_initial_state.tolist() == [True, False]
    assert sliding.state_indices.data_ptr() == meta.state_indices.data_ptr()


def test_graphs_only_on_cuda_with_triton_kernels():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert should_use_graphs(True, cuda, True)
    assert not should_use_graphs(False, cuda, True)  # enable_cuda_graphs=False
    assert not should_use_graphs(True, cuda, False)  # PAGODA_KERNELS=torch: references are not graph-safe
    assert not should_use_graphs(True, cpu, True)  # e.g. interpreter on CPU


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    (folder / "config.json").write_text(json.dumps(TINY))
    return str(folder)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_cpu_runner_never_captures(tiny_folder, kernels, monkeypatch):
    monkeypatch.setenv("PAGODA_KERNELS", kernels)
    reload_settings()
    config = EngineConfig(model=tiny_folder, device="cpu", load_format="dummy", enable_cuda_graphs=True,
                          num_gpu_blocks_override=8)  # fmt: skip
    runner = ModelRunner(config, config_from_dict(TINY), tiny_folder)
    assert runner.graphs is None


def test_failed_capture_falls_back_to_eager(tiny_folder, monkeypatch, caplog):
    import pagoda.engine.runner.cuda_graphs as cuda_graphs

    def broken_capture(self):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(cuda_graphs, "should_use_graphs", lambda *args: True)
    monkeypatch.setattr(DecodeGraphs, "capture", broken_capture)
    config = EngineConfig(model=tiny_folder, device="cpu", load_format="dummy", num_gpu_blocks_override=8)
    runner = ModelRunner(config, config_from_dict(TINY), tiny_folder)
    assert runner.graphs is None
    assert "CUDA graph capture failed" in caplog.text


class _FakeGraph:
    """Replays like a CUDA graph: re-runs the captured forward on the static buffers and
    writes the result into the tensor the capture returned."""

    def __init__(self, graphs: DecodeGraphs, size: int, output: torch.Tensor) -> None:
        self.graphs, self.size, self.output = graphs, size, output

    def replay(self) -> None:
        self.output.copy_(self.graphs._forward(self.size))


def _fake_capture(graphs: DecodeGraphs) -> None:
    for size in graphs.sizes:
        graphs.inputs.fill([], size)
        output = graphs._forward(size).clone()
        graphs._graphs[size] = (_FakeGraph(graphs, size, output), output)


def _runner(folder: str, max_num_seqs: int) -> ModelRunner:
    config = EngineConfig(model=folder, device="cpu", load_format="dummy", block_size=RUNNER_BLOCK_SIZE,
                          num_gpu_blocks_override=24, max_num_seqs=max_num_seqs, max_model_len=40)  # fmt: skip
    return ModelRunner(config, config_from_dict(TINY), folder)


@pytest.mark.parametrize("placeholders", [False, True])
def test_padded_replay_matches_eager_steps_through_the_triton_kernels(tiny_folder, monkeypatch, placeholders):
    """Two runners on the same weights: one eager, one with (fake) graphs over the real
    padded static buffers, both on the Triton kernels. Every step's logits and the whole
    KV cache agree, so padding writes nothing and the frozen max context is harmless.
    With ``placeholders`` (async scheduling) the graphed runner's decode rows carry no
    token id: it takes the previous step's samples it keeps on the device."""
    monkeypatch.setenv("PAGODA_KERNELS", "triton")
    reload_settings()
    eager, graphed = _runner(tiny_folder, 4), _runner(tiny_folder, 4)
    assert torch.equal(eager.model.embed_tokens, graphed.model.embed_tokens)  # same seed, same weights
    graphed.graphs = DecodeGraphs(graphed.model, graphed.kv_caches, 4, 40, RUNNER_BLOCK_SIZE)
    _fake_capture(graphed.graphs)
    assert sorted(graphed.graphs._graphs) == [1, 2, 4]
    tables = {"a": [3, 7, 1, 5, 9, 11], "b": [2, 6], "c": [10, 4, 8]}
    prompts = {"a": [5, 9, 13, 17, 21, 25, 29], "b": [40, 41, 42], "c": [60, 61, 62, 63, 64, 65]}
    lens, last = {}, {}
    # (sequence, samples?) per step: prefills, decodes of 2 and of 3 (padded to 4, one row
    # not sampling), a mixed step (eager in both), decodes again.
    plan = [[("a", True), ("b", True)], [("a", True), ("b", True)], [("a", True), ("b", True), ("c", True)],
            [("a", True), ("b", False), ("c", True)], [("a", True), ("c", True)]]  # fmt: skip
    for entries in plan:
        step = []
        for name, sampling in entries:
            if name not in lens:
                step.append(item(0, 0, tables[name], num_new=len(prompts[name])))
                step[-1].token_ids = prompts[name]
            else:
                step.append(item(last[name], lens[name], tables[name], is_sampling=sampling))
        is_decode = all(s.num_new_tokens == 1 for s in step)
        assert graphed.graphs.can_run(step) == is_decode
        expected = eager.compute_logits(step)
        if placeholders:
            step = [SimpleNamespace(**{**vars(s), "token_ids": [], "request_id": name})
                    if name in lens else s for (name, _), s in zip(entries, step)]
        actual = graphed.compute_logits(step)
        if placeholders:
            sampled_names = [name for name, sampling in entries if sampling]
            tokens = expected.argmax(-1).tolist()
            graphed.record_sampled(ModelRunnerOutput(sampled_names, [[t] for t in tokens]))
        # Graphed and eager differ only in rounding (padded matmuls block differently):
        # twice the derived float32 bound of each against exact logits.
        bound = 2 * model_error_bound(config_from_dict(TINY), 64, torch.float32, expected.abs().max().item())
        assert_within(actual, expected, bound, "graphed vs eager logits")
        sampled = iter(expected.argmax(-1).tolist())
        for (name, sampling), s in zip(entries, step):
            lens[name] = s.num_computed_tokens + s.num_new_tokens
            last[name] = next(sampled) if sampling else last.get(name, 1)
    for (ek, ev), (gk, gv) in zip(eager.kv_caches, graphed.kv_caches):
        for e, g in ((ek, gk), (ev, gv)):
            assert torch.equal(e == 0, g == 0), "the padded replay wrote a slot the eager steps did not"
            # matmuls of 4 rows vs 3 round apart: the same derived bound, at the KV's scale
            kv_bound = 2 * model_error_bound(config_from_dict(TINY), 64, torch.float32, e.abs().max().item())
            assert_within(g, e, kv_bound, "graphed vs eager KV cache")


def test_frozen_max_context_with_forced_split_k_matches_reference(monkeypatch):
    """The graph metadata (max_seq_len = max context, dummy rows) through split-K with
    slices that hold no key for the real rows: the real rows equal the float64 reference."""
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim, num_blocks = 8, 2, 64, 40
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    inputs = DecodeInputs(max_batch=4, max_context=128, block_size=BLOCK_SIZE, device="cpu")
    step = [item(1, 9, [5, 17, 3]), item(2, 20, [30, 31, 8, 9, 10, 11])]
    inputs.fill(step, 4)
    meta = inputs.metadata(4)
    q = torch.randn(4, num_heads, head_dim)
    out = triton_attention.paged_attention(q, k_cache, v_cache, meta, 0.125, AttentionConfig(4, 32, num_splits=4))
    real = AttentionMetadata.build([1, 1], [10, 21], [s.block_ids for s in step], BLOCK_SIZE)
    expected = reference.paged_attention_ref(q[:2].double(), k_cache.double(), v_cache.double(), real, 0.125)
    # float32 attention: a score's error (head_dim terms, at most 0.125 * head_dim * |q| |k|)
    # moves its softmax weight by as much relative, twice over (numerator and sum); the
    # softmax sum and P@V add 2 * context terms; all at the scale of |v|.
    score_magnitude = 0.125 * head_dim * q.abs().max().item() * k_cache.abs().max().item()
    bound = (2 * gamma(head_dim, torch.float32) * score_magnitude + gamma(2 * 21, torch.float32)) \
        * v_cache.abs().max().item()
    assert_within(out[:2], expected, bound, "split-K attention vs float64")
    assert torch.isfinite(out).all()  # dummy rows too


def test_random_model_is_seeded():
    config = config_from_dict(TINY)
    a = make_random_model(config, torch.float32, torch.device("cpu"), seed=3)
    b = make_random_model(config, torch.float32, torch.device("cpu"), seed=3)
    c = make_random_model(config, torch.float32, torch.device("cpu"), seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.embed_tokens, c.embed_tokens)
    assert torch.equal(a.layers[0].input_norm, torch.ones(64))
