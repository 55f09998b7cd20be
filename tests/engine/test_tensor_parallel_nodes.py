"""A replica over two "nodes" (engine/parallel/node.py): the leader engine holds rank 0 and a
separate `pagoda serve --nodes 2 --node-rank 1 --leader-address HOST:PORT` process holds
rank 1, joining over gloo on CPU — as a LeaderWorkerSet's worker pod joins its leader.

Specification: greedy tokens of TP=2, and of PP=2 (node 1 holding the last stage), equal a
one-device engine's on a tiny random model (the node's rank got every setting from the
leader's store); when the leader shuts down, the node's process
exits 0 by itself; a node whose flags disagree with the leader's is refused naming the flag.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pagoda.engine.config import EngineConfig
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.sampling_params import SamplingParams

from tests.engine.hf_reference import make_random_model

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _node(leader: str, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'backend'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.Popen([sys.executable, "-m", "pagoda.cli", "serve", "--nodes", "2", "--node-rank", "1",
                             "--leader-address", leader, *extra], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _greedy(engine: LLMEngine) -> dict[str, list[int]]:
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a quiet village"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), engine.tokenizer.encode(prompt), params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


@pytest.mark.parametrize("field", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_a_rank_on_another_node_joins_the_leader_and_tokens_match_tp1(tmp_path, smollm2_path, field):
    """TP=2 or PP=2 (then node 1 holds the last stage) with one rank per node."""
    path = str(make_random_model(tmp_path / "tiny", "llama-gqa4-hd80-untied", smollm2_path))
    reference = LLMEngine(EngineConfig(model=path))
    try:
        expected = _greedy(reference)
    finally:
        reference.shutdown()
    leader = f"127.0.0.1:{_free_port()}"
    node = _node(leader, "--" + field.replace("_", "-"), "2")  # started first: it waits for the leader's store
    try:
        engine = LLMEngine(EngineConfig(model=path, **{field: 2}, tensor_parallel_nodes=2,
                                        tensor_parallel_leader=leader, tensor_parallel_timeout_s=120))
        try:
            assert not engine.executor.parallel.processes, "node 0 runs only rank 0 here (one rank per node)"
            got = _greedy(engine)
        finally:
            engine.shutdown()
        output, _ = node.communicate(timeout=60)
        assert node.returncode == 0, output  # the leader's stop ended the node's rank in order
        assert "ranks 1..1 of 2" in output, output
    finally:
        if node.poll() is None:
            node.kill()
    assert got == expected


def test_bad_node_flags_are_refused_naming_the_flag():
    for extra, message in ((["--node-rank", "2"], "--node-rank"), ([], None)):
        args = [sys.executable, "-m", "pagoda.cli", "serve", "--nodes", "2", *extra]
        env = dict(os.environ, PYTHONPATH=str(REPO / "backend"))
        result = subprocess.run(args, env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
        assert result.returncode != 0
        assert (message or "--leader-address") in result.stderr, result.stderr
    with pytest.raises(ValueError, match="tensor_parallel_nodes"):
        EngineConfig(tensor_parallel_size=3, tensor_parallel_nodes=2, tensor_parallel_leader="h:1")
    with pytest.raises(ValueError, match="tensor_parallel_leader"):
        EngineConfig(tensor_parallel_size=2, tensor_parallel_nodes=2)
