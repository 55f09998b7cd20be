"""Make ``gpu_carry/`` for examples/gpu_hybrid_check.py on a CPU machine with the test
environment: tiny random Qwen3-Next and Qwen3.5 folders (built as
tests/engine/test_hybrid_engine.py builds them, SmolLM2's tokenizer) and transformers' greedy
tokens (24 per prompt, float32, CPU) in ``gpu_carry/expected.json``. The folder is ignored by
git and travels to the device with the working tree (``run``'s ``carry``).
Usage: ``.venv/bin/python examples/gpu_hybrid_prepare.py``."""

import json
import sys

sys.path.insert(0, ".")

from pagoda.models.gguf_import import ensure_default_model  # noqa: E402
from tests.engine.driving import family_case  # noqa: E402
from tests.engine.hf_reference import save_random_model  # noqa: E402
from tests.engine.test_hybrid_engine import ARCHS, SMALL, _move_constants  # noqa: E402

tokenizer = str(ensure_default_model())
cases = {}
for name in ("qwen3-next", "qwen3.5"):
    config_class, overrides = ARCHS[name]
    folder = save_random_model(f"gpu_carry/{name}", tokenizer, 0, config_class, edit_weights=_move_constants,
                               **{**SMALL, **overrides})
    _, prompts, expected, _ = family_case(folder, 24)
    cases[name] = {"prompts": prompts, "expected": expected}
with open("gpu_carry/expected.json", "w") as f:
    json.dump(cases, f)
print("gpu_carry/: " + ", ".join(cases))
