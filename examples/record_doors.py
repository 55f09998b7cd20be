"""Record served outputs on the default model through every door, to compare two trees.

Starts ``pagoda serve`` (tritonserver + its OpenAI door) on free ports, sends the same
prompts with the same sampling settings as ``record_outputs.py`` (greedy, seeded top-k/top-p,
n = 2 with logprobs, penalties with min_tokens) through:

- Triton gRPC streaming (tritonclient, vLLM-backend dialect: ``sampling_parameters`` JSON),
- Triton HTTP ``generate`` (JSON body, the generate extension),
- TensorRT-LLM scalar inputs on pagoda's model (tritonclient gRPC, ``max_tokens`` INT32 ...),
- TensorRT-LLM's ``ensemble`` front (tritonclient gRPC, batched ``[1, 1]`` inputs, unary),
- TensorRT-LLM's LLM-API ``tensorrt_llm`` front (tritonclient gRPC, unary),
- the OpenAI door (openai SDK: completions with logprobs, chat),

and writes every answer (texts, finish reasons, token counts, logprobs) as JSON.
Usage: ``python examples/record_doors.py out.json``; run it on each tree and compare the files.
"""

import json
import socket
import subprocess
import sys
import time

import numpy as np

PROMPTS = ["The capital of France is", "Write a haiku about tea", "def fibonacci(n):",
           "List three colours:", "Once upon a time", "The meaning of life is"]
RUNS = {
    "greedy": {"temperature": 0, "max_tokens": 24},
    "seeded": {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "max_tokens": 24, "seed": 7},
    "n2": {"temperature": 1.0, "n": 2, "max_tokens": 12, "seed": 3, "logprobs": 2},
    "penalties": {"temperature": 0.7, "repetition_penalty": 1.3, "presence_penalty": 0.5, "max_tokens": 16,
                  "seed": 11, "min_tokens": 4},
}
TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def grpc_stream(client, prompt: str, sampling: dict) -> list:
    import tritonclient.grpc as grpcclient

    results, done = [], []

    def callback(result, error):
        if error is not None:
            results.append({"error": str(error)})
            done.append(True)
            return
        response = result.get_response()
        out = {name: result.as_numpy(name).tolist() for name in
               ("text_output", "finish_reason", "num_output_tokens", "logprobs") if result.as_numpy(name) is not None}
        results.append(out)
        if response.parameters.get("triton_final_response") and response.parameters[
                "triton_final_response"].bool_param:
            done.append(True)

    inputs = []
    for name, value, dtype in (("text_input", [prompt.encode()], "BYTES"),
                               ("sampling_parameters", [json.dumps(sampling).encode()], "BYTES"),
                               ("stream", [True], "BOOL"), ("return_finish_reason", [True], "BOOL"),
                               ("return_num_output_tokens", [True], "BOOL"), ("return_logprobs", [True], "BOOL"),
                               ("exclude_input_in_output", [True], "BOOL")):
        tensor = grpcclient.InferInput(name, [1], dtype)
        tensor.set_data_from_numpy(np.array(value, dtype=np.object_ if dtype == "BYTES" else bool))
        inputs.append(tensor)
    client.start_stream(callback=callback, stream_timeout=TIMEOUT_S)
    client.async_stream_infer("pagoda", inputs, enable_empty_final_response=True)
    deadline = time.monotonic() + TIMEOUT_S
    while not done and time.monotonic() < deadline:
        time.sleep(0.01)
    client.stop_stream()
    return [decode(r) for r in results]


def decode(value):
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, list):
        return [decode(v) for v in value]
    if isinstance(value, dict):
        return {k: decode(v) for k, v in value.items()}
    return value


def trtllm_scalars(client, prompt: str, sampling: dict) -> dict:
    import tritonclient.grpc as grpcclient

    inputs = []
    types = {"max_tokens": ("INT32", np.int32), "min_tokens": ("INT32", np.int32), "top_k": ("INT32", np.int32),
             "temperature": ("FP32", np.float32), "top_p": ("FP32", np.float32), "seed": ("UINT64", np.uint64),
             "repetition_penalty": ("FP32", np.float32), "presence_penalty": ("FP32", np.float32)}
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    inputs.append(text)
    for key, value in sampling.items():
        if key in types:
            tensor = grpcclient.InferInput(key, [1], types[key][0])
            tensor.set_data_from_numpy(np.array([value], dtype=types[key][1]))
            inputs.append(tensor)
    for name in ("exclude_input_in_output", "return_finish_reason", "return_num_output_tokens"):
        flag = grpcclient.InferInput(name, [1], "BOOL")
        flag.set_data_from_numpy(np.array([True]))
        inputs.append(flag)
    client.start_stream(callback=lambda result, error: answers.append((result, error)), stream_timeout=TIMEOUT_S)
    answers: list = []
    client.async_stream_infer("pagoda", inputs, enable_empty_final_response=True)
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline and not any(
            e is not None or r.get_response().parameters["triton_final_response"].bool_param for r, e in answers):
        time.sleep(0.01)
    client.stop_stream()
    out = []
    for result, error in answers:
        if error is not None:
            out.append({"error": str(error)})
        elif result.as_numpy("text_output") is not None:
            out.append({n: decode(result.as_numpy(n).tolist()) for n in
                        ("text_output", "finish_reason", "num_output_tokens") if result.as_numpy(n) is not None})
    return out


def infer_inputs(values: dict) -> list:
    """tritonclient inputs of ``{name: (array, datatype)}``."""
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, (array, dtype) in values.items():
        tensor = grpcclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def ensemble(client, prompt: str, sampling: dict) -> dict:
    values = {"text_input": (np.array([[prompt.encode()]], dtype=np.object_), "BYTES"),
              "max_tokens": (np.array([[sampling["max_tokens"]]], dtype=np.int32), "INT32"),
              "temperature": (np.array([[sampling["temperature"]]], dtype=np.float32), "FP32"),
              "return_log_probs": (np.array([[True]]), "BOOL"),
              "exclude_input_in_output": (np.array([[True]]), "BOOL")}
    for key, dtype, np_dtype in (("top_k", "INT32", np.int32), ("top_p", "FP32", np.float32),
                                 ("seed", "UINT64", np.uint64), ("repetition_penalty", "FP32", np.float32),
                                 ("presence_penalty", "FP32", np.float32), ("min_tokens", "INT32", np.int32)):
        if key in sampling:
            values[key] = (np.array([[sampling[key]]], dtype=np_dtype), dtype)
    if sampling.get("n", 1) > 1:
        values["num_return_sequences"] = (np.array([[sampling["n"]]], dtype=np.int32), "INT32")
    try:
        result = client.infer("ensemble", infer_inputs(values), client_timeout=TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001
        return {"error": str(exc)}
    return {n: decode(result.as_numpy(n).tolist()) for n in ("text_output", "cum_log_probs", "output_log_probs")
            if result.as_numpy(n) is not None}


def llmapi(client, prompt: str, sampling: dict) -> dict:
    values = {"text_input": (np.array([prompt.encode()], dtype=np.object_), "BYTES"),
              "sampling_param_exclude_input_from_output": (np.array([True]), "BOOL"),
              "return_finish_reason": (np.array([True]), "BOOL")}
    for key, dtype, np_dtype in (("max_tokens", "INT32", np.int32), ("temperature", "FP32", np.float32),
                                 ("top_k", "INT32", np.int32), ("top_p", "FP32", np.float32),
                                 ("seed", "UINT64", np.uint64), ("presence_penalty", "FP32", np.float32)):
        if key in sampling:
            values[f"sampling_param_{key}"] = (np.array([sampling[key]], dtype=np_dtype), dtype)
    try:
        result = client.infer("tensorrt_llm", infer_inputs(values), client_timeout=TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001
        return {"error": str(exc)}
    return {n: decode(result.as_numpy(n).tolist()) for n in ("text_output", "finish_reason")
            if result.as_numpy(n) is not None}


def http_generate(url: str, prompt: str, sampling: dict) -> dict:
    import urllib.request

    body = json.dumps({"text_input": prompt, "sampling_parameters": json.dumps(sampling),
                       "exclude_input_in_output": True, "return_finish_reason": True,
                       "return_num_output_tokens": True, "return_logprobs": True}).encode()
    request = urllib.request.Request(f"{url}/v2/models/pagoda/generate", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return json.loads(response.read())
    except Exception as exc:  # noqa: BLE001
        return {"error": str(exc)}


def openai_calls(base_url: str, prompt: str, sampling: dict) -> dict:
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="none", timeout=TIMEOUT_S, max_retries=0)
    extra = {k: sampling[k] for k in ("top_k", "repetition_penalty", "min_tokens") if k in sampling}
    common = {k: sampling[k] for k in ("temperature", "top_p", "seed", "presence_penalty", "n", "max_tokens")
              if k in sampling}
    out = {}
    completion = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt,
                                            logprobs=sampling.get("logprobs"), extra_body=extra, **common)
    out["completions"] = [(c.text, c.finish_reason, c.logprobs and [round(x, 4) for x in c.logprobs.token_logprobs])
                          for c in completion.choices]
    chat = client.chat.completions.create(model="SmolLM2-135M-Instruct",
                                          messages=[{"role": "user", "content": prompt}],
                                          logprobs=bool(sampling.get("logprobs")),
                                          top_logprobs=sampling.get("logprobs"), extra_body=extra, **common)
    out["chat"] = [(c.message.content, c.finish_reason,
                    c.logprobs and [round(t.logprob, 4) for t in c.logprobs.content]) for c in chat.choices]
    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", stream=True,
                                            messages=[{"role": "user", "content": prompt}], extra_body=extra, **common)
    pieces: dict = {}
    for chunk in stream:
        for choice in chunk.choices:
            pieces.setdefault(choice.index, []).append(choice.delta.content or "")
    out["chat_stream"] = {str(k): "".join(v) for k, v in sorted(pieces.items())}
    return out


def main(path: str) -> None:
    import tritonclient.grpc as grpcclient

    ports = {name: free_port() for name in ("http", "grpc", "metrics", "openai")}
    command = [sys.executable, "-m", "pagoda.cli", "serve", "--http-port", str(ports["http"]),
               "--grpc-port", str(ports["grpc"]), "--metrics-port", str(ports["metrics"]),
               "--openai-port", str(ports["openai"]), "--max-num-seqs", "4"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in server.stdout:
            if "OpenAI" in line and "http" in line:
                break
            if server.poll() is not None:
                raise SystemExit("pagoda serve exited before it was ready")
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{ports['grpc']}")
        res = {}
        for name, sampling in RUNS.items():
            for prompt in PROMPTS:
                key = f"{name}/{prompt}"
                res[f"grpc/{key}"] = grpc_stream(client, prompt, sampling)
                res[f"http/{key}"] = http_generate(f"http://127.0.0.1:{ports['http']}", prompt, sampling)
                if "n" not in sampling:
                    res[f"trtllm_scalars/{key}"] = trtllm_scalars(client, prompt, sampling)
                    res[f"llmapi/{key}"] = llmapi(client, prompt, sampling)
                res[f"ensemble/{key}"] = ensemble(client, prompt, sampling)
                res[f"openai/{key}"] = openai_calls(f"http://127.0.0.1:{ports['openai']}/v1", prompt, sampling)
        json.dump(res, open(path, "w"), indent=1, sort_keys=True)
        print("recorded", len(res))
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    main(sys.argv[1])
