"""config.pbtxt parameters <-> EngineConfig, and the launcher's rewrite of them."""

from pathlib import Path

import pytest

from pagoda.serving.launch.serve_options import ServeOptions, materialize_repository
from pagoda.serving.launch.serve_flags import make_parser, options_from_args
from pagoda.serving.model_config import engine_config_from_parameters, rewrite_config_pbtxt

REPOSITORY = Path(__file__).resolve().parents[2] / "model_repository"


def parameters_of(text):
    """Parse our one-line ``parameters { key: ... value: { string_value: ... } }`` form."""
    import re

    return {m.group(1): {"string_value": m.group(2)}
            for m in re.finditer(r'key:\s*"([^"]+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"', text)}


def test_shipped_config_is_decoupled_and_reads_as_engine_defaults():
    text = (REPOSITORY / "pagoda" / "config.pbtxt").read_text()
    assert "decoupled: true" in text and "kind: KIND_CPU" in text
    config = engine_config_from_parameters(parameters_of(text))
    assert config.model is None and config.block_size == 16 and config.enable_prefix_caching is True


def test_types_and_errors():
    config = engine_config_from_parameters({"block_size": "32", "enable_chunked_prefill": {"string_value": "false"},
                                            "gpu_memory_utilization": "0.5", "model": "/m"})
    assert (config.block_size, config.enable_chunked_prefill, config.gpu_memory_utilization, config.model) == (
        32, False, 0.5, "/m")
    with pytest.raises(ValueError, match="block_sise: unknown"):
        engine_config_from_parameters({"block_sise": "16"})
    with pytest.raises(ValueError, match="max_num_seqs: cannot read 'many'"):
        engine_config_from_parameters({"max_num_seqs": "many"})
    with pytest.raises(ValueError, match="block_size: must be one of"):
        engine_config_from_parameters({"block_size": "12"})


def test_rewrite_replaces_adds_and_switches_kind():
    text = (REPOSITORY / "pagoda" / "config.pbtxt").read_text()
    out = rewrite_config_pbtxt(text, {"block_size": "32", "model": '/a "b"', "seed": "7", "dtype": None}, "KIND_GPU")
    params = parameters_of(out)
    assert params["block_size"]["string_value"] == "32"
    assert params["seed"]["string_value"] == "7"
    assert params["dtype"]["string_value"] == "auto"
    assert 'string_value: "/a \\"b\\""' in out
    assert "kind: KIND_GPU" in out and "KIND_CPU" not in out.split("instance_group")[1]


def test_serve_flags_reach_the_materialized_config(tmp_path):
    args = make_parser().parse_args(["--model", "/models/x", "--block-size", "32", "--max-num-seqs", "4",
                                     "--no-prefix-caching", "--device", "cuda", "--http-port", "9000"])
    options = options_from_args(args)
    assert isinstance(options, ServeOptions) and options.http_port == 9000
    repo = materialize_repository(REPOSITORY, tmp_path / "repo", options)
    text = (repo / "pagoda" / "config.pbtxt").read_text()
    config = engine_config_from_parameters(parameters_of(text))
    assert (config.model, config.block_size, config.max_num_seqs, config.enable_prefix_caching, config.device) == (
        "/models/x", 32, 4, False, "cuda")
    assert config.enable_chunked_prefill is True
    assert "kind: KIND_GPU" in text
    assert (repo / "pagoda" / "1" / "model.py").exists()


@pytest.mark.parametrize("field", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_tensor_or_pipeline_parallel_size_makes_the_instance_kind_model(tmp_path, field):
    flag = "--" + field.replace("_", "-")
    options = options_from_args(make_parser().parse_args([flag, "2", "--device", "cuda"]))
    text = (materialize_repository(REPOSITORY, tmp_path / "repo", options) / "pagoda" / "config.pbtxt").read_text()
    assert getattr(engine_config_from_parameters(parameters_of(text)), field) == 2
    assert "kind: KIND_MODEL" in text.split("instance_group")[1]


def test_node_zero_of_a_multi_node_replica_gets_the_group_layout_in_its_config(tmp_path):
    """`--nodes 2` on node 0 (the LeaderWorkerSet leader's flags): the engine learns the node count
    and the store address it opens; worker nodes' flags never reach a config.pbtxt (no server)."""
    args = ["--tensor-parallel-size", "4", "--nodes", "2", "--node-rank", "0",
            "--leader-address", "big-group-0.big:29500"]
    options = options_from_args(make_parser().parse_args(args))
    text = (materialize_repository(REPOSITORY, tmp_path / "repo", options) / "pagoda" / "config.pbtxt").read_text()
    config = engine_config_from_parameters(parameters_of(text))
    assert (config.tensor_parallel_size, config.tensor_parallel_nodes, config.tensor_parallel_leader) == (
        4, 2, "big-group-0.big:29500")


def test_engine_flags_and_engine_args_reach_the_config(tmp_path):
    args = ["--speculative-method", "ngram", "--num-speculative-tokens", "3", "--cpu-offload-bytes", "1048576",
            "--preemption-mode", "swap", "--scheduling-policy", "priority", "--engine-arg", "spec_adaptive=false",
            "--max-waiting-requests", "16", "--max-waiting-prompt-tokens", "50000",
            "--long-prefill-token-threshold", "96"]
    options = options_from_args(make_parser().parse_args(args))
    repo = materialize_repository(REPOSITORY, tmp_path / "repo", options)
    config = engine_config_from_parameters(parameters_of((repo / "pagoda" / "config.pbtxt").read_text()))
    assert (config.speculative_method, config.num_speculative_tokens, config.spec_adaptive) == ("ngram", 3, False)
    assert (config.cpu_offload_bytes, config.preemption_mode, config.scheduling_policy) == (1048576, "swap", "priority")
    assert (config.max_waiting_requests, config.max_waiting_prompt_tokens) == (16, 50000)
    assert config.scheduling.long_prefill_token_threshold == 96


def test_file_tier_flags_reach_the_config(tmp_path):
    args = ["--cpu-offload-bytes", "1048576", "--kv-disk-dir", "/cache/kv", "--kv-disk-bytes", "4096",
            "--kv-shared-dir", "/shared/kv", "--kv-write-through"]
    repo = materialize_repository(REPOSITORY, tmp_path / "repo", options_from_args(make_parser().parse_args(args)))
    config = engine_config_from_parameters(parameters_of((repo / "pagoda" / "config.pbtxt").read_text()))
    assert (config.kv_disk_dir, config.kv_disk_bytes, config.kv_shared_dir) == ("/cache/kv", 4096, "/shared/kv")
    assert config.kv_write_through is True


@pytest.mark.parametrize("args, message", [
    (["--engine-arg", "bogus=1"], "bogus: unknown"),
    (["--engine-arg", "novalue"], "FIELD=VALUE"),
    (["--preemption-mode", "swap"], "cpu_offload_bytes"),
    (["--kv-disk-dir", "/cache/kv", "--kv-disk-bytes", "4096"], "kv_disk_dir: the file tiers are written from"),
    (["--num-speculative-tokens", "0"], "num_speculative_tokens"),
    (["--max-waiting-requests", "0"], "max_waiting_requests"),
    (["--long-prefill-token-threshold", "-5"], "long_prefill_token_threshold: must be >= 0"),
    (["--kv-events-config", '{"enable_kv_cache_events": true, "endpont": "tcp://*:5557"}'],
     "--kv-events-config: unknown key(s) endpont"),
    (["--kv-events-config", "{oops"], "--kv-events-config: not JSON"),
    (["--tensor-parallel-size", "3", "--nodes", "2", "--leader-address", "h:29500"], "tensor_parallel_nodes"),
    (["--tensor-parallel-size", "2", "--nodes", "2", "--leader-address", "h:port"], "tensor_parallel_leader"),
    (["--leader-address", "h:29500"], "--leader-address: only with --nodes > 1"),
    (["--kv-transfer-backend", "nixl"], "--kv-transfer-backend needs --kv-transfer-listen"),
    # a decode replica without a connector would recompute every prompt, warning per request
    (["--role", "decode"], "--role decode needs --kv-transfer-listen"),
    (["--role", "prefill", "--redis-url", "redis://x:6379"], "--role prefill needs --kv-transfer-listen"),
    (["--kv-transfer-listen", "0.0.0.0:0", "--kv-transfer-backend", "shm"], "invalid choice: 'shm'"),
])
def test_bad_engine_flags_are_refused_before_tritonserver_starts(args, message, capsys):
    from pagoda.serving.launch.serve_cli import main

    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code != 0
    assert message in str(exc.value.code) + capsys.readouterr().err


def test_lora_modules_parameter_as_pairs_or_json_and_bad_forms_refused():
    from pagoda.serving.model_config import engine_config_from_parameters

    config = engine_config_from_parameters({"enable_lora": "true", "lora_modules": "a=/x/a, b=/y/b"})
    assert config.enable_lora and config.lora_modules == {"a": "/x/a", "b": "/y/b"}
    config = engine_config_from_parameters({"enable_lora": "1", "lora_modules": '{"c": "/z"}'})
    assert config.lora_modules == {"c": "/z"}
    with pytest.raises(ValueError, match="expected name=path pairs"):
        engine_config_from_parameters({"enable_lora": "true", "lora_modules": "a"})
    with pytest.raises(ValueError, match="enable_lora is False"):
        engine_config_from_parameters({"lora_modules": "a=/x"})


def test_allow_runtime_lora_flag_reaches_the_config_and_turns_lora_on(tmp_path):
    from pagoda.serving.model_config import allow_runtime_lora

    shipped = parameters_of((REPOSITORY / "pagoda" / "config.pbtxt").read_text())
    assert allow_runtime_lora(shipped) is False and allow_runtime_lora({}) is False
    options = options_from_args(make_parser().parse_args(["--allow-runtime-lora"]))
    params = parameters_of((materialize_repository(REPOSITORY, tmp_path / "repo", options)
                            / "pagoda" / "config.pbtxt").read_text())
    assert allow_runtime_lora(params) is True and engine_config_from_parameters(params).enable_lora
    with pytest.raises(ValueError, match="allow_runtime_lora: cannot read 'maybe'"):
        allow_runtime_lora({"allow_runtime_lora": {"string_value": "maybe"}})


def test_output_dialect_and_vllm_metrics_switch_from_flags_to_parameters(tmp_path):
    from pagoda.serving.model_config import output_dialect, report_custom_metrics

    shipped = (Path(__file__).resolve().parents[2] / "model_repository" / "pagoda" / "config.pbtxt").read_text()
    assert 'key: "output_dialect" value: { string_value: "vllm" }' in shipped
    assert output_dialect({}) == "vllm" and report_custom_metrics({}) is True
    options = options_from_args(make_parser().parse_args(["--output-dialect", "vllm", "--no-vllm-metrics"]))
    parameters = {name: {"string_value": value} for name, value in options.parameter_overrides().items() if value}
    assert output_dialect(parameters) == "vllm" and report_custom_metrics(parameters) is False
    with pytest.raises(ValueError, match="output_dialect: must be one of vllm, pagoda, got 'openai'"):
        output_dialect({"output_dialect": "openai"})
    with pytest.raises(ValueError, match="REPORT_CUSTOM_METRICS: cannot read 'maybe'"):
        report_custom_metrics({"REPORT_CUSTOM_METRICS": {"string_value": "maybe"}})
    engine_config_from_parameters(parameters)  # serving parameters are not engine fields, and not refused


def test_kv_transfer_backend_flag_reaches_the_config_and_unknown_names_are_refused(tmp_path):
    from pagoda.serving.model_config import kv_transfer_backend

    shipped = parameters_of((REPOSITORY / "pagoda" / "config.pbtxt").read_text())
    assert "kv_transfer_backend" in shipped and kv_transfer_backend(shipped) == "tcp" == kv_transfer_backend({})
    options = options_from_args(make_parser().parse_args(["--kv-transfer-listen", "127.0.0.1:0",
                                                          "--kv-transfer-backend", "nixl"]))
    params = parameters_of((materialize_repository(REPOSITORY, tmp_path / "repo", options)
                            / "pagoda" / "config.pbtxt").read_text())
    assert kv_transfer_backend(params) == "nixl" and params["kv_transfer_listen"]["string_value"] == "127.0.0.1:0"
    engine_config_from_parameters(params)  # a serving parameter, not an engine field
    with pytest.raises(ValueError, match="KV transfer backend 'rdma': must be one of tcp, nixl"):
        kv_transfer_backend({"kv_transfer_backend": {"string_value": "rdma"}, "kv_transfer_listen": "h:1"})
    with pytest.raises(ValueError, match="kv_transfer_backend 'nixl' needs kv_transfer_listen"):
        kv_transfer_backend({"kv_transfer_backend": "nixl"})
