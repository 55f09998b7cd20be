"""House rules that keep the code readable in one sitting (docs/architecture.md).

- no module of the package, the operator or the Triton adapter over ``MAX_MODULE_LINES``;
- no function in ``engine/`` over ``MAX_ENGINE_FUNCTION_LINES`` (the scheduler, the core
  and the runner are where features pile up as branches: give a feature its own helper);
- no source line (the package, the operator, the Triton adapter and the tests) over
  ``MAX_LINE_CHARS`` characters: break a long line where it reads well, never by renaming;
- the engine core and the KV-cache bookkeeping import no torch: they are tested on CPU
  with fake runner outputs, and a tensor-parallel step broadcasts what they produce.
"""

from __future__ import annotations

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 450
MAX_ENGINE_FUNCTION_LINES = 60
MAX_LINE_CHARS = 120
SOURCES = [REPO / "backend" / "pagoda", REPO / "operator" / "pagoda_operator", REPO / "model_repository"]
TORCH_FREE = ["engine/core", "engine/request_groups", "engine/kv", "engine/client.py",
              "engine/scheduler_output.py", "engine/request.py", "engine/sampling_params.py", "engine/config.py",
              "engine/cache_config.py", "contracts",
              # the KV connector's protocol, wire and TCP threads; only block_io.py touches tensors
              "engine/kv_transfer/connector.py", "engine/kv_transfer/wire.py", "engine/kv_transfer/offer.py",
              "engine/kv_transfer/tcp_sender.py", "engine/kv_transfer/tcp_receiver.py"]


def _modules(*roots: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for root in roots for p in root.rglob("*.py"))


def test_no_module_over_the_limit():
    long = {str(p.relative_to(REPO)): n for p in _modules(*SOURCES)
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by concept): {long}"


def test_no_source_line_over_the_limit():
    long = [f"{p.relative_to(REPO)}:{i} ({len(line)} characters)"
            for p in _modules(*SOURCES, REPO / "tests")
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if len(line) > MAX_LINE_CHARS]
    assert not long, f"lines over {MAX_LINE_CHARS} characters:\n" + "\n".join(long)


def test_no_engine_function_over_the_limit():
    long = {}
    for path in _modules(REPO / "backend" / "pagoda" / "engine"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_ENGINE_FUNCTION_LINES:
                    long[f"{path.relative_to(REPO)}:{node.lineno} {node.name}"] = length
    assert not long, f"engine functions over {MAX_ENGINE_FUNCTION_LINES} lines: {long}"


def test_the_core_and_the_kv_bookkeeping_import_no_torch():
    engine = REPO / "backend" / "pagoda"
    offenders = []
    for entry in TORCH_FREE:
        target = engine / entry
        for path in _modules(target) if target.is_dir() else [target]:
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                offenders += [f"{path.relative_to(REPO)}:{node.lineno} imports {n}" for n in names
                              if n.split(".")[0] in ("torch", "triton", "numpy")]
    assert not offenders, "torch-free modules importing torch/triton/numpy:\n" + "\n".join(offenders)


def test_the_serving_loop_types_its_collaborators():
    """``EngineLoop`` names what it needs (``EngineClient``, ``StepObserver``, ...), never ``Any``."""
    path = REPO / "backend" / "pagoda" / "serving" / "engine_loop.py"
    loop = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == "EngineLoop")
    init = next(n for n in loop.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    untyped = [a.arg for a in init.args.args[1:] + init.args.kwonlyargs
               if a.annotation is None or "Any" in ast.unparse(a.annotation)]
    assert not untyped, f"EngineLoop collaborators without a type: {untyped}"


def test_the_doors_type_their_collaborators():
    """The router's doors (``fleet/api``) name what they are given (``Router``, ``Gate``,
    ``GrpcUpstream``, ``OpenAIRequest``, ``Tokenizer``, ...), never ``Any``: every constructor
    and ``make_app``, as ``EngineLoop`` does."""
    api = REPO / "backend" / "pagoda" / "fleet" / "api"
    untyped = []
    for path in _modules(api):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                functions = [f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"]
            elif isinstance(node, ast.FunctionDef) and node.name == "make_app":
                functions = [node]
            else:
                continue
            for function in functions:
                untyped += [f"{path.name}:{function.lineno} {a.arg}" for a in function.args.args[1:]
                            + function.args.kwonlyargs if a.annotation is None or "Any" in ast.unparse(a.annotation)]
    assert not untyped, f"door collaborators without a type: {untyped}"


def test_every_module_is_in_the_architecture_pages_room_table():
    """docs/architecture.md names every module in its room table (``## The rooms``), so a
    newcomer finds any file there; a new module is added to its room's row in the same change."""
    import re

    doc = (REPO / "docs" / "architecture.md").read_text()
    rooms = doc[doc.index("## The rooms"):doc.index("## The seams")]
    named = {part for name in re.findall(r"`([A-Za-z_][\w/.]*)`", rooms) for part in re.split(r"[/.]", name)}
    sources = _modules(REPO / "backend" / "pagoda", REPO / "operator" / "pagoda_operator")
    missing = [str(p.relative_to(REPO)) for p in sources if p.stem != "__init__" and p.stem not in named]
    assert not missing, f"modules missing from docs/architecture.md's room table: {missing}"
