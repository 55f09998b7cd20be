"""Checks that make ``pagoda serve`` fail loudly instead of serving errors.

- ``check_stub_numpy``: before tritonserver starts, ask the ``python3`` the stub will run
  (the first on ``PATH``, as the launcher sets it) which numpy it imports. tritonserver
  2.51's Python-backend stub (nvidia-pytriton 0.7.0) reads string tensors with numpy 1.x
  semantics; under numpy 2 the server still becomes READY and then the stub aborts on the
  first request (``deserialize_bytes_tensor ... unpack_from requires a buffer``).
- ``send_first_request``: after READY, one small greedy request goes through the whole
  path (HTTP front end -> stub -> engine -> response); the endpoints are announced only
  if it comes back with text.
- ``diagnose``: a failure's known cause, read from the server log tail.
"""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request
from typing import Mapping, Optional

# Log fragments with a known cause, checked in order.
KNOWN_CAUSES = (
    (("deserialize_bytes_tensor", "unpack_from requires a buffer"),
     "the Python-backend stub cannot read string tensors: numpy>=2 in the stub's environment "
     "(tritonserver 2.51 needs numpy<2: pip install 'numpy<2')"),
    (("is not healthy",), "the Python-backend stub died"),
    (("ModuleNotFoundError", "ImportError"), "the model could not import a module in the stub's environment"),
)


class StartupCheckError(RuntimeError):
    """The server cannot serve; the message says why and what to do."""


def stub_numpy_version(env: Mapping[str, str]) -> Optional[str]:
    """numpy's version as the stub's ``python3`` imports it (``None`` if it cannot say)."""
    try:
        result = subprocess.run(["python3", "-c", "import numpy; print(numpy.__version__)"], env=dict(env),
                                capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def check_numpy_version(version: Optional[str]) -> None:
    """Raises:
        StartupCheckError: numpy 2 or newer, which this tritonserver build cannot use.
    """
    if version is None:
        return
    try:
        major = int(version.split(".", 1)[0])
    except ValueError:
        return
    if major >= 2:
        raise StartupCheckError(
            f"numpy {version} is installed where the Python-backend stub runs; tritonserver 2.51 "
            "(nvidia-pytriton 0.7.0) needs numpy<2 (under numpy 2 the server turns READY, then every "
            "request fails). Fix: pip install 'numpy<2'")


def send_first_request(http_url: str, model_name: str, timeout_s: float) -> str:
    """Send one greedy one-token request over HTTP ``/generate`` and return its text.

    Raises:
        StartupCheckError: no answer, an error answer, or an answer without text.
    """
    body = json.dumps({"text_input": "Hello", "max_tokens": 1, "temperature": 0.0}).encode()
    request = urllib.request.Request(f"http://{http_url}/v2/models/{model_name}/generate", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as error:
        detail = error.read().decode(errors="replace")[:500]
        raise StartupCheckError(f"the first request failed with HTTP {error.code}: {detail}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise StartupCheckError(f"the first request got no answer in {timeout_s:.0f} s: {exc}") from None
    if not isinstance(answer, dict) or "text_output" not in answer:
        raise StartupCheckError(f"the first request's answer has no text_output: {str(answer)[:300]}")
    return str(answer["text_output"])


def diagnose(log_tail: str) -> Optional[str]:
    """The known cause of a failure whose server log ends with ``log_tail``, if any."""
    for fragments, cause in KNOWN_CAUSES:
        if any(fragment in log_tail for fragment in fragments):
            return cause
    return None
