"""The engine core is the "token ids only" half: it imports no torch.

``EngineCore`` schedules, launches the device job through the ``Executor`` protocol and
applies the ``ModelRunnerOutput``; the runner, sampler, speculator and host KV tier are
built outside (``pagoda.engine.runner.executor.make_executor``). Two checks: no module of
``engine/core`` (its ``sched/`` room included) or ``engine/request_groups`` names torch in any import (function-local
and ``TYPE_CHECKING`` ones included), and importing the engine core in a fresh interpreter leaves torch unloaded.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ENGINE = pathlib.Path(__file__).resolve().parents[2] / "backend" / "pagoda" / "engine"
CORE = ENGINE / "core"


def _imported_modules(path: pathlib.Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.append((node.lineno, node.module or ""))
    return found


def test_no_core_module_imports_torch():
    modules = sorted(CORE.rglob("*.py")) + sorted((ENGINE / "request_groups").rglob("*.py"))
    offenders = [f"{path.relative_to(ENGINE)}:{line}: {module}" for path in modules
                 for line, module in _imported_modules(path) if module.split(".")[0] == "torch"]
    assert offenders == []


def test_importing_the_engine_core_does_not_load_torch():
    code = ("import sys; import pagoda.engine.core.engine_core, pagoda.engine.core.sched.scheduler, "
            "pagoda.engine.request_groups.beam_search; "
            "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'torch'); print(loaded[:3])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            env=None, cwd=CORE.parents[3])
    assert result.stdout.strip() == "[]", result.stdout + result.stderr
