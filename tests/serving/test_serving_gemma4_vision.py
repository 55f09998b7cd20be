"""Gemma 4 with images through the doors: a tiny random ``Gemma4ForConditionalGeneration`` served by
a real tritonserver equals the offline engine, through the vLLM dialect's ``image`` input
(tritonclient, gRPC stream) and the OpenAI door's ``image_url`` data URLs (the openai SDK, via the
router child).

The folder is ``tests/engine/gemma4_vision_reference.save_gemma4``'s (whose engine output equals
transformers', tests/engine/test_gemma4_vision_engine.py): its ``<|image|>`` is token 49000,
SmolLM2's `` Antim`` (one token wherever it is written), so text can hold it, and a chat template
writes it for each image part, as Gemma 4's writes ``<|image|>``. The server expands each into
``<|image>``, the image's soft tokens (a count by its aspect ratio) and ``<image|>``, whose attention
within the image is both ways on the sliding layers.
One server for the module; every client call has a timeout.
"""

from __future__ import annotations

import base64
import io
import json

import pytest

from pagoda.engine.llm import LLM
from pagoda.engine.sampling_params import SamplingParams
from tests.engine.gemma4_vision_reference import save_gemma4
from tests.engine.vision_reference import random_image
from tests.serving.test_serving_lifecycle import ServeProcess
from tests.serving.test_serving_vllm_dialect import grpc_stream, texts

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.server

IMAGE_TEXT = " Antim"  # token 49000 of SmolLM2's vocabulary: this folder's <|image|>
TEMPLATE = ("{% for m in messages %}<start_of_turn>{{ m.role }}\n{% if m.content is string %}{{ m.content }}"
            "{% else %}{% for p in m.content %}{% if p.type == 'image' %}" + IMAGE_TEXT + "{% else %}{{ p.text }}"
            "{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
            "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
GREEDY = {"temperature": 0, "max_tokens": 5}


def _png(seed: int, width: int = 64, height: int = 64) -> bytes:
    out = io.BytesIO()
    random_image(seed, width, height).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def gemma_folder(tmp_path_factory, smollm2_path):
    folder = save_gemma4(tmp_path_factory.mktemp("gemma4-served") / "gemma4", smollm2_path)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "chat_template": TEMPLATE}))
    return str(folder)


@pytest.fixture(scope="module")
def served(gemma_folder):
    from pagoda.serving.launch.launcher import find_free_port

    port = find_free_port()
    process = ServeProcess("--model", gemma_folder, "--openai-port", str(port), "--max-model-len", "512",
                           "--max-num-seqs", "4")
    try:
        process.wait_serving()
        process.grpc_url = f"127.0.0.1:{process.ports[1]}"
        process.openai = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                                       timeout=120)
        yield process
    finally:
        process.stop()


def test_gemma4_images_through_the_doors_equal_the_offline_engine(gemma_folder, served):
    one, two = _png(1), _png(2, 96, 48)  # 64 and 55 soft tokens
    prompts = [("<start_of_turn>user\n" + IMAGE_TEXT + " What is it?<end_of_turn>\n<start_of_turn>model\n", [one]),
               ("<start_of_turn>user\n" + IMAGE_TEXT + " or" + IMAGE_TEXT + "?<end_of_turn>\n<start_of_turn>model\n",
                [two, one]),
               ("<start_of_turn>user\n" + IMAGE_TEXT + " Describe.<end_of_turn>\n<start_of_turn>model\n", [two])]
    llm = LLM(model=gemma_folder, max_model_len=512)
    outputs = llm.generate([{"prompt": p, "multi_modal_data": {"image": images}} for p, images in prompts],
                           SamplingParams(**GREEDY), use_tqdm=False)
    expected = [o.outputs[0].text for o in outputs]
    assert len(set(expected[:2])) == 2 and all(expected)

    for (prompt, images), text in zip(prompts[:2], expected):
        results, error = grpc_stream(served, prompt, sampling=GREEDY, stream=True,
                                     exclude_input_in_output=True, images=[base64.b64encode(i) for i in images])
        assert error is None and "".join(texts(results)) == text

    url = "data:image/png;base64," + base64.b64encode(two).decode()
    response = served.openai.chat.completions.create(
        model=served.openai.models.list().data[0].id, temperature=0, max_tokens=GREEDY["max_tokens"],
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                               {"type": "text", "text": " Describe."}]}])
    assert response.choices[0].message.content == expected[2]

    _, error = grpc_stream(served, prompts[0][0], sampling=GREEDY, images=[base64.b64encode(one)] * 2)
    assert error is not None and "prompt: 1 image placeholders (token id 49000) for 2 images" in error, error
    results, error = grpc_stream(served, prompts[0][0], sampling=GREEDY, images=[base64.b64encode(one)])
    assert error is None and texts(results), "the server keeps serving"
