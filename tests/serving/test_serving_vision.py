"""Images through the doors: a tiny random Qwen3-VL served by a real tritonserver equals the
offline engine, through the vLLM dialect's ``image`` input (tritonclient, gRPC stream) and the
OpenAI door's ``image_url`` data URLs (the openai SDK; ``pagoda serve``'s door is a ``pagoda
router`` child, so the images also pass through the router).

The folder is ``tests/engine/vision_reference.save_qwen3_vl``'s (whose engine output equals
transformers', tests/engine/test_vision_engine.py) with two edits so text can hold the image
placeholder: ``image_token_id`` is 49001 (SmolLM2's `` Salvation``, one token wherever it is
written) instead of 49000 (which SmolLM2 does not write back as one token), and a chat template
that writes that token for each image part, as Qwen3-VL's writes ``<|image_pad|>``. The engine
ignores ``vision_start_token_id``; the weights do not depend on either id. One server for the
module, fetching ``http(s)`` image URLs from 127.0.0.1 only (``--allowed-media-domains``); every
client call has a timeout.
"""

from __future__ import annotations

import base64
import io
import json
import re

import pytest

from pagoda.engine.llm import LLM
from pagoda.engine.sampling_params import SamplingParams
from tests.engine.vision_reference import random_image, save_qwen3_vl
from tests.serving.test_serving_lifecycle import ServeProcess
from tests.serving.test_serving_vllm_dialect import grpc_stream, texts

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.server

IMAGE_TEXT = " Salvation"  # token 49001 of SmolLM2's vocabulary: the placeholder in this folder
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}"
            "{% else %}{% for p in m.content %}{% if p.type == 'image' %}" + IMAGE_TEXT + "{% else %}{{ p.text }}"
            "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MAX_TOKENS = 6
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS}


def _png(seed: int) -> bytes:
    out = io.BytesIO()
    random_image(seed).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def vl_folder(tmp_path_factory, smollm2_path):
    folder = save_qwen3_vl(tmp_path_factory.mktemp("vision") / "qwen3-vl", smollm2_path)
    config = json.loads((folder / "config.json").read_text())
    config.update(image_token_id=49001, vision_start_token_id=49000)
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "chat_template": TEMPLATE}))
    return str(folder)


@pytest.fixture(scope="module")
def served(vl_folder):
    from pagoda.serving.launch.launcher import find_free_port

    port = find_free_port()
    process = ServeProcess("--model", vl_folder, "--openai-port", str(port), "--max-model-len", "256",
                           "--max-num-seqs", "4", "--allowed-media-domains", "127.0.0.1")
    try:
        process.wait_serving()
        process.grpc_url = f"127.0.0.1:{process.ports[1]}"
        process.openai = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                                       timeout=120)
        yield process
    finally:
        process.stop()


def _offline(folder: str, requests: list[tuple[str, list[bytes]]]) -> list[str]:
    llm = LLM(model=folder, max_model_len=256)
    outputs = llm.generate([{"prompt": p, "multi_modal_data": {"image": images}} for p, images in requests],
                           SamplingParams(**GREEDY))
    return [o.outputs[0].text for o in outputs]


def _chat_prompt(text_parts: list[str], images: int) -> str:
    user = IMAGE_TEXT * images + "".join(text_parts)
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def test_images_through_the_vllm_dialect_and_the_openai_door_equal_the_offline_engine(vl_folder, served):
    one, two = _png(1), _png(2)
    prompts = [("<|im_start|>user\n" + IMAGE_TEXT + " What is it?<|im_end|>\n<|im_start|>assistant\n", [one]),
               ("<|im_start|>user\n" + IMAGE_TEXT + " or" + IMAGE_TEXT + "?<|im_end|>\n<|im_start|>assistant\n",
                [two, one]),
               (_chat_prompt([" Describe."], 1), [two])]
    expected = _offline(vl_folder, prompts)
    assert len(set(expected[:2])) == 2 and all(expected)

    for (prompt, images), text in zip(prompts[:2], expected):
        results, error = grpc_stream(served, prompt, sampling=GREEDY, stream=True,
                                     exclude_input_in_output=True, images=[base64.b64encode(i) for i in images])
        assert error is None and "".join(texts(results)) == text

    url = "data:image/png;base64," + base64.b64encode(two).decode()
    response = served.openai.chat.completions.create(
        model=served.openai.models.list().data[0].id, temperature=0, max_tokens=MAX_TOKENS,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                               {"type": "text", "text": " Describe."}]}])
    assert response.choices[0].message.content == expected[2]


def test_bad_images_are_400s_naming_the_field_and_the_server_keeps_serving(served):
    prompt = "<|im_start|>user\n" + IMAGE_TEXT + " What?<|im_end|>\n"
    for images, field in (([b"%%% not base64"], "image[0]: not valid base64"),
                          ([base64.b64encode(b"not an image at all")], "multi_modal_data.image[0]"),
                          ([base64.b64encode(_png(1))] * 2, "prompt: 1 image placeholders")):
        _, error = grpc_stream(served, prompt, sampling=GREEDY, images=images)
        assert error is not None and field in error, error
    model = served.openai.models.list().data[0].id

    def chat(url):
        return served.openai.chat.completions.create(model=model, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}])

    for url, field in (("data:image/png;base64,%%%", "payload is not valid base64"),
                       ("data:image/png;base64," + base64.b64encode(b"GIF? no").decode(), "multi_modal_data.image[0]"),
                       ("https://example.com/cat.png", "the host 'example.com' is not on this server's allow-list"),
                       ("ftp://example.com/cat.png", "unsupported image URL scheme 'ftp'")):
        with pytest.raises(openai.BadRequestError, match=re.escape(field)):
            chat(url)
    assert chat("data:image/png;base64," + base64.b64encode(_png(3)).decode()).choices[0].message.content
    results, error = grpc_stream(served, prompt, sampling=GREEDY,
                                 images=[base64.b64encode(_png(3))])
    assert error is None and texts(results)


def _anthropic(served):
    anthropic = pytest.importorskip("anthropic")
    base = str(served.openai.base_url).rstrip("/").removesuffix("/v1")
    return anthropic, anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=120)


def _b64(image: bytes) -> str:
    return base64.b64encode(image).decode()


def test_images_through_the_messages_and_responses_doors_equal_the_offline_engine(vl_folder, served):
    """Anthropic's ``image`` blocks (base64 and data: URL sources; the anthropic SDK) and the
    Responses API's ``input_image`` parts (the openai SDK) answer the offline engine's text."""
    one, two = _png(1), _png(2)
    prompts = [(_chat_prompt([" Describe."], 1), [one]), (_chat_prompt([" or", "?"], 2), [one, two])]
    expected = _offline(vl_folder, prompts)
    _, client = _anthropic(served)
    model = served.openai.models.list().data[0].id
    base64_block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _b64(one)}}
    url_block = {"type": "image", "source": {"type": "url", "url": "data:image/png;base64," + _b64(two)}}
    answers = [client.messages.create(model=model, max_tokens=MAX_TOKENS, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": content}]) for content in (
        [base64_block, {"type": "text", "text": " Describe."}],
        [base64_block, url_block, {"type": "text", "text": " or"}, {"type": "text", "text": "?"}])]
    assert [answer.content[0].text for answer in answers] == expected
    counted = client.messages.count_tokens(model=model, messages=[  # the placeholders as the replica expands them
        {"role": "user", "content": [base64_block, url_block, {"type": "text", "text": " or"}]}])
    usage = client.messages.create(model=model, max_tokens=1, messages=[
        {"role": "user", "content": [base64_block, url_block, {"type": "text", "text": " or"}]}]).usage
    assert counted.input_tokens == usage.input_tokens > 2 * 4

    response = served.openai.responses.create(model=model, max_output_tokens=MAX_TOKENS, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64," + _b64(one)},
                                     {"type": "input_text", "text": " Describe."}]}])
    assert response.output_text == expected[0]


def test_bad_images_on_the_messages_and_responses_doors_are_400s_naming_the_field(served):
    anthropic, client = _anthropic(served)
    model = served.openai.models.list().data[0].id
    png = _b64(_png(3))
    for content, field in (
            ([{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "%%%"}}],
             "messages[0].content[0].source.data: the data: URL's payload is not valid base64"),
            ([{"type": "image", "source": {"type": "base64", "media_type": "text/plain", "data": png}}],
             "messages[0].content[0].source.media_type: must be image/"),
            ([{"type": "text", "text": "x"}, {"type": "image", "source": {"type": "url", "url": "ftp://h/a.png"}}],
             "messages[0].content[1].source.url: unsupported image URL scheme 'ftp'"),
            ([{"type": "image", "source": {"type": "file", "file_id": "file_1"}}],
             "messages[0].content[0].source.type: file sources are not served"),
            ([{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _b64(b"no")}}],
             "multi_modal_data.image[0]")):
        with pytest.raises(anthropic.BadRequestError, match=re.escape(field)):
            client.messages.create(model=model, max_tokens=2, messages=[{"role": "user", "content": content}])
    with pytest.raises(anthropic.BadRequestError, match=re.escape("messages[1].content[0]: image blocks are taken")):
        client.messages.create(model=model, max_tokens=2, messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": png}}]}])
    for part, field in (({"type": "input_image", "image_url": "data:image/png;base64,%%%"},
                         "input[0].content[0].image_url: the data: URL's payload is not valid base64"),
                        ({"type": "input_image", "file_id": "file_1"}, "input[0].content[0].image_url: required"),
                        ({"type": "input_image", "image_url": "https://example.com/a.png"},
                         "input[0].content[0].image_url: the host 'example.com' is not on this server's allow-list")):
        with pytest.raises(openai.BadRequestError, match=re.escape(field)):
            served.openai.responses.create(model=model, max_output_tokens=2, input=[
                {"role": "user", "content": [part]}])
    answer = client.messages.create(model=model, max_tokens=2, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}]}])
    assert answer.content and answer.content[0].text


def _llmapi(served, prompt: str, urls: list[str], max_tokens: int = MAX_TOKENS):
    """TensorRT-LLM's LLM-API ``tensorrt_llm`` model (unary, as ``pagoda serve`` ships it) over gRPC:
    (text, None) or (None, the error's message)."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    arrays = {"text_input": (np.array([prompt.encode()], dtype=np.object_), "BYTES"),
              "sampling_param_temperature": (np.array([0.0], dtype=np.float32), "FP32"),
              "sampling_param_max_tokens": (np.array([max_tokens], dtype=np.int32), "INT32"),
              "sampling_param_exclude_input_from_output": (np.array([True]), "BOOL")}
    if urls:
        arrays["image_url"] = (np.array([u.encode() for u in urls], dtype=np.object_), "BYTES")
    inputs = []
    for name, (array, dtype) in arrays.items():
        inputs.append(grpcclient.InferInput(name, list(array.shape), dtype))
        inputs[-1].set_data_from_numpy(array)
    client = grpcclient.InferenceServerClient(served.grpc_url)
    try:
        result = client.infer("tensorrt_llm", inputs, client_timeout=120)
        return result.as_numpy("text_output")[0].decode(), None
    except InferenceServerException as exc:
        return None, str(exc)
    finally:
        client.close()


def test_image_urls_through_tensorrt_llms_llm_api_input_equal_the_offline_engine(vl_folder, served):
    """The LLM-API model's ``image_url`` input (data: URLs, one per placeholder) through
    tritonclient, and its refusals naming ``image_url[i]``; the server keeps serving."""
    one, two = _png(1), _png(2)
    prompt = "<|im_start|>user\n" + IMAGE_TEXT + " or" + IMAGE_TEXT + "?<|im_end|>\n<|im_start|>assistant\n"
    [expected] = _offline(vl_folder, [(prompt, [two, one])])
    urls = ["data:image/png;base64," + _b64(image) for image in (two, one)]
    assert _llmapi(served, prompt, urls) == (expected, None)
    for bad, message in ((["data:image/png;base64,%%%"], "image_url[0]: the data: URL's payload is not valid"),
                         ([urls[0], "file:///etc/passwd"], "image_url[1]: unsupported image URL scheme 'file'"),
                         (["https://example.com/a.png"], "image_url[0]: the host 'example.com' is not on"),
                         ([urls[0]], "prompt: 2 image placeholders")):
        text, error = _llmapi(served, prompt, bad, max_tokens=2)
        assert text is None and message in error, error
    assert _llmapi(served, prompt, urls)[0] == expected


@pytest.fixture(scope="module")
def image_host():
    """A local HTTP server with two PNGs and redirects (on and off the allow-list)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    files = {"/one.png": _png(1), "/two.png": _png(2)}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            if self.path in ("/hop", "/off"):
                self.send_response(302)
                self.send_header("Location", "/two.png" if self.path == "/hop" else "http://example.com/two.png")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body = files.get(self.path)
            self.send_response(200 if body else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


def test_http_image_urls_from_an_allow_listed_host_equal_the_offline_engine(vl_folder, served, image_host):
    """``--allowed-media-domains 127.0.0.1``: an http URL (and one redirected on that host) through the
    OpenAI chat door, the Messages API's url source and the LLM-API ``image_url`` input answers as
    the image sent inline; a redirect off the list and a missing file are 400s naming the field."""
    chat_prompt = _chat_prompt([" Describe."], 1)
    llmapi_prompt = "<|im_start|>user\n" + IMAGE_TEXT + " or" + IMAGE_TEXT + "?<|im_end|>\n<|im_start|>assistant\n"
    expected = _offline(vl_folder, [(chat_prompt, [_png(2)]), (llmapi_prompt, [_png(2), _png(1)])])
    model = served.openai.models.list().data[0].id

    def chat(url, max_tokens=MAX_TOKENS):
        return served.openai.chat.completions.create(model=model, temperature=0, max_tokens=max_tokens, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": " Describe."}]}]).choices[0].message.content

    assert chat(image_host + "/two.png") == chat(image_host + "/hop") == expected[0]
    _, client = _anthropic(served)
    answer = client.messages.create(model=model, max_tokens=MAX_TOKENS, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": image_host + "/two.png"}},
                                     {"type": "text", "text": " Describe."}]}])
    assert answer.content[0].text == expected[0]
    assert _llmapi(served, llmapi_prompt, [image_host + "/two.png", image_host + "/one.png"]) == (expected[1], None)
    for path, message in (("/off", "the host 'example.com' is not on this server's allow-list"),
                          ("/missing.png", "answered HTTP 404")):
        with pytest.raises(openai.BadRequestError,
                           match=re.escape("messages[0].content[0].image_url.url: ") + ".*" + re.escape(message)):
            chat(image_host + path, max_tokens=2)
        text, error = _llmapi(served, llmapi_prompt, [image_host + path, image_host + "/one.png"], max_tokens=2)
        assert text is None and "image_url[0]: " in error and message in error, error


def test_the_vllm_dialects_image_input_through_the_router_equals_the_offline_engine(vl_folder, served):
    """The door's router (``pagoda serve``'s OpenAI door is a ``pagoda router`` child) takes the
    vLLM dialect's ``image`` input on its Triton HTTP generate route, hashes the images to route
    the request (``routing.image_routing``) and passes them on: the replica's answer is the offline
    engine's; a non-image is the replica's 400, and the next request is served."""
    from tests.serving.test_serving_triton_server import http_post

    prompt = "<|im_start|>user\n" + IMAGE_TEXT + " What is it?<|im_end|>\n<|im_start|>assistant\n"
    [expected] = _offline(vl_folder, [(prompt, [_png(4)])])
    door = type("Door", (), {"http_url": str(served.openai.base_url).split("//")[1].split("/")[0]})()
    sampling = json.dumps({"temperature": 0, "max_tokens": MAX_TOKENS})

    def generate(images):
        return http_post(door, "/v2/models/pagoda/generate", {
            "text_input": prompt, "image": images, "exclude_input_in_output": True, "sampling_parameters": sampling})

    status, body = generate([_b64(_png(4))])
    assert status == 200 and body["text_output"] == expected, body
    status, body = generate([_b64(b"not an image")])
    assert status == 400 and "multi_modal_data.image[0]" in json.dumps(body), body
    status, body = generate([_b64(_png(4))])
    assert status == 200 and body["text_output"] == expected
