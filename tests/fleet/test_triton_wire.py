"""The router's reading and editing of Triton gRPC messages (``fleet.triton_wire``), on
messages built by tritonclient's own protobuf classes."""

import struct

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2

from pagoda.fleet.triton_wire import (bytes_elements, bytes_raw, infer_inputs, infer_request, keep_outputs,
                                      output_number, output_text, replace_output, request_parameters)


def _client_request(binary: bool):
    """A request as tritonclient builds it (raw contents, or typed contents with binary_data off)."""
    inputs = []
    for name, array, datatype in (("text_input", np.array([b"h\xc3\xa9"], dtype=np.object_), "BYTES"),
                                  ("max_tokens", np.array([7], dtype=np.int32), "INT32"),
                                  ("stream", np.array([True]), "BOOL"),
                                  ("seed", np.array([2 ** 40], np.uint64), "UINT64"),
                                  ("temperature", np.array([0.5], dtype=np.float32), "FP32"),
                                  ("input_ids", np.array([[1, 2], [3, 4]], dtype=np.int32), "INT32")):
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    request = service_pb2.ModelInferRequest(model_name="pagoda", id="r1")
    for tensor in inputs:
        request.inputs.extend([tensor._get_tensor()])
        if binary and tensor._get_content() is not None:
            request.raw_input_contents.append(tensor._get_content())
    return request


@pytest.mark.parametrize("binary", [True, False])
def test_a_requests_inputs_read_back_as_numpy_whichever_encoding(binary):
    request = _client_request(binary)
    if not binary:  # typed contents, as a client without binary data sends them
        for tensor, values in zip(request.inputs, ([b"h\xc3\xa9"], [7], [True], [2 ** 40], [0.5], [1, 2, 3, 4])):
            field = {"BYTES": "bytes_contents", "INT32": "int_contents", "BOOL": "bool_contents",
                     "UINT64": "uint64_contents", "FP32": "fp32_contents"}[tensor.datatype]
            getattr(tensor.contents, field).extend(values)
    arrays = infer_inputs(request)
    assert arrays["text_input"].tolist() == [b"h\xc3\xa9"] and arrays["max_tokens"].dtype == np.int32
    assert arrays["stream"].tolist() == [True] and arrays["seed"].tolist() == [2 ** 40]
    assert arrays["temperature"].tolist() == [0.5] and arrays["input_ids"].tolist() == [[1, 2], [3, 4]]
    rebuilt = infer_request("pagoda", "r1", arrays, {"traceparent": "00-t", "sequence_start": True})
    assert {k: v.tolist() for k, v in infer_inputs(rebuilt).items()} == {k: v.tolist() for k, v in arrays.items()}
    assert request_parameters(rebuilt) == {"traceparent": "00-t", "sequence_start": True}


def test_a_request_whose_contents_do_not_fill_its_shape_is_refused_naming_the_input():
    request = service_pb2.ModelInferRequest()
    request.inputs.add(name="max_tokens", datatype="INT32", shape=[2])
    request.raw_input_contents.append(struct.pack("<i", 7))
    with pytest.raises(ValueError, match="^max_tokens: 1 elements do not fill its shape"):
        infer_inputs(request)


def test_outputs_of_a_response_are_read_replaced_and_kept():
    response = service_pb2.ModelInferResponse()
    for name, datatype, raw in (("text_output", "BYTES", bytes_raw([b"Hello"])),
                                ("num_output_tokens", "UINT32", struct.pack("<I", 2)),
                                ("kv_transfer_params", "BYTES", bytes_raw([b"{}"]))):
        tensor = response.outputs.add()
        tensor.name, tensor.datatype = name, datatype
        response.raw_output_contents.append(raw)
    assert output_text(response, "text_output") == "Hello" and output_number(response, "num_output_tokens") == 2
    replace_output(response, "text_output", bytes_raw([b"lo"]))
    assert bytes_elements(response.raw_output_contents[0]) == [b"lo"]
    keep_outputs(response, {"text_output", "num_output_tokens"})
    assert [t.name for t in response.outputs] == ["text_output", "num_output_tokens"]
    assert output_number(response, "num_output_tokens") == 2 and output_text(response, "kv_transfer_params") is None
