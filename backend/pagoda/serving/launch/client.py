"""A small tritonclient helper for pagoda's streaming generation (tests, bench, docs).

``make_inputs`` builds the contract-1 input tensors for ``tritonclient.grpc``;
``stream_generate`` sends one request on its own gRPC stream (``tritonclient.grpc.aio``)
and yields each response as a dict of decoded outputs, ending at the final response.

A stream per request keeps cancellation simple: cancelling the stream's iterator cancels
exactly that request on the server (Triton then reports ``is_cancelled()`` to the model).
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Optional

import numpy as np

MODEL_NAME = "pagoda"


def make_inputs(prompt: str, sampling_parameters: Optional[dict[str, Any]] = None, *, stream: bool = True,
                **flags: bool) -> list:
    """Contract-1 inputs for ``tritonclient.grpc``: text, stream, JSON params, flags.

    Args:
        prompt: the text prompt.
        sampling_parameters: ``SamplingParams`` fields as a dict (sent as JSON).
        stream: ask for token deltas.
        flags: boolean inputs such as ``exclude_input_in_output=True``,
            ``return_finish_reason=True``, ``return_num_output_tokens=True``.
    """
    from tritonclient import grpc as grpcclient

    def tensor(name: str, value: Any, datatype: str) -> Any:
        array = np.array([value], dtype=np.object_ if datatype == "BYTES" else bool)
        t = grpcclient.InferInput(name, [1], datatype)
        t.set_data_from_numpy(array)
        return t

    inputs = [tensor("text_input", prompt.encode("utf-8"), "BYTES"), tensor("stream", stream, "BOOL")]
    if sampling_parameters:
        inputs.append(tensor("sampling_parameters", json.dumps(sampling_parameters).encode("utf-8"), "BYTES"))
    for name, value in flags.items():
        inputs.append(tensor(name, bool(value), "BOOL"))
    return inputs


def decode_result(result: Any) -> dict[str, Any]:
    """A ``tritonclient`` result as ``{output name: python value(s)}`` (one completion: scalar)."""
    out: dict[str, Any] = {}
    for output in result.get_response().outputs:
        array = result.as_numpy(output.name)
        if array is None:
            continue
        values = [v.decode("utf-8") if isinstance(v, bytes) else v.item() for v in array.reshape(-1)]
        out[output.name] = values[0] if len(values) == 1 else values
    return out


async def stream_generate(client: Any, prompt: str, sampling_parameters: Optional[dict[str, Any]] = None, *,
                          stream: bool = True, request_id: str = "", **flags: bool) -> AsyncIterator[dict[str, Any]]:
    """Send one request on a new stream of ``client`` (a ``tritonclient.grpc.aio`` client).

    Yields:
        Each response's decoded outputs, in order.

    Raises:
        tritonclient.utils.InferenceServerException: the server answered with an error.
    """

    async def requests():
        yield {"model_name": MODEL_NAME, "inputs": make_inputs(prompt, sampling_parameters, stream=stream, **flags),
               "request_id": request_id}

    responses = client.stream_infer(requests())
    try:
        async for result, error in responses:
            if error is not None:
                raise error
            yield decode_result(result)
    finally:
        responses.cancel()
