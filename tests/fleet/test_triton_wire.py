"""The router's reading and editing of Triton gRPC messages (``fleet.triton_wire``), on
messages built by tritonclient's own protobuf classes."""

import struct

from tritonclient.grpc import service_pb2

from pagoda.fleet.triton_wire import (bytes_elements, bytes_raw, drop_parameters, keep_outputs, output_number,
                                      output_text, replace_output, request_parameters, scalar_inputs)


def test_scalar_inputs_and_parameters_of_a_request():
    request = service_pb2.ModelInferRequest()
    for name, datatype, raw in (("max_tokens", "INT32", struct.pack("<i", 7)), ("stream", "BOOL", b"\x01"),
                                ("seed", "UINT64", struct.pack("<Q", 2 ** 40)),
                                ("text_input", "BYTES", bytes_raw([b"hi"]))):
        tensor = request.inputs.add()
        tensor.name, tensor.datatype = name, datatype
        request.raw_input_contents.append(raw)
    assert scalar_inputs(request) == {"max_tokens": 7, "stream": True, "seed": 2 ** 40}
    request.parameters["max_tokens"].int64_param = 5
    request.parameters["cache_salt"].string_param = "s"
    assert request_parameters(request) == {"max_tokens": 5, "cache_salt": "s"}
    drop_parameters(request, ("max_tokens", "min_tokens"))
    assert request_parameters(request) == {"cache_salt": "s"}


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
