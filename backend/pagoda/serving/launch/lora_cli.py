"""``pagoda lora load|unload|list``: LoRA adapters loaded and unloaded at run time.

Sends one LoRA control request (``lora_action``, ``lora_name``, ``lora_path``; see
``serving.dialects.pagoda.read_lora_control`` and docs/lora.md) to Triton's generate endpoint of a
replica (``pagoda serve --allow-runtime-lora``) or of the router, which applies it to
every replica it routes to. The answer is the JSON document the replica (or router)
puts in ``text_output``; an error answer (HTTP 4xx/5xx, Triton's ``{"error": ...}``)
is printed as is and the command exits 1.

``lora_control_inputs`` builds the same request for ``tritonclient.grpc`` (the model is
decoupled: send it on a stream, one final response comes back).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Optional

from pagoda.contracts.errors import error_text

MODEL_NAME = "pagoda"


class LoRAControlError(RuntimeError):
    """The server refused the control request, or could not be reached; the message says why."""


def control_body(action: str, name: Optional[str] = None, path: Optional[str] = None) -> dict[str, str]:
    """The generate-endpoint JSON body of one control request."""
    body = {"lora_action": action}
    if name is not None:
        body["lora_name"] = name
    if path is not None:
        body["lora_path"] = path
    return body


def lora_control_inputs(action: str, name: Optional[str] = None, path: Optional[str] = None) -> list:
    """The control request as ``tritonclient.grpc.InferInput``s (BYTES tensors of one element)."""
    import numpy as np
    from tritonclient import grpc as grpcclient

    inputs = []
    for key, value in control_body(action, name, path).items():
        tensor = grpcclient.InferInput(key, [1], "BYTES")
        tensor.set_data_from_numpy(np.array([value.encode("utf-8")], dtype=np.object_))
        inputs.append(tensor)
    return inputs


def lora_control(url: str, action: str, name: Optional[str] = None, path: Optional[str] = None,
                 api_key: Optional[str] = None, timeout_s: float = 300.0) -> dict[str, Any]:
    """Send one control request over HTTP and return the answer's JSON document.

    Args:
        url: ``http://host:port`` of a replica or the router.
        action: ``load``, ``unload`` or ``list``.
        api_key: sent as ``Authorization: Bearer`` (the router's API keys).

    Raises:
        LoRAControlError: the error the server answered, or why it could not be reached.
    """
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(f"{url.rstrip('/')}/v2/models/{MODEL_NAME}/generate",
                                     data=json.dumps(control_body(action, name, path)).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as error:
        raise LoRAControlError(f"{url} answered {error.code}: {error_text(error.read())}") from None
    except (urllib.error.URLError, OSError) as error:
        raise LoRAControlError(f"cannot reach {url}: {getattr(error, 'reason', error)}") from None
    text = answer.get("text_output") if isinstance(answer, dict) else None
    if isinstance(text, list) and len(text) == 1:
        text = text[0]
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        raise LoRAControlError(f"{url} did not answer a LoRA control document (is it a pagoda replica or "
                               f"router?): {str(answer)[:200]}") from None


def _add_server_options(parser: argparse.ArgumentParser, url: Any, api_key: Any) -> None:
    parser.add_argument("--url", default=url,
                        help="the replica's or router's HTTP address (default http://localhost:8000)")
    parser.add_argument("--api-key", default=api_key, help="the router's API key (default: $PAGODA_API_KEY)")


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda lora", description="Load, unload and list LoRA adapters of a "
                                     "running replica (pagoda serve --allow-runtime-lora) or router.")
    _add_server_options(parser, "http://localhost:8000", os.environ.get("PAGODA_API_KEY"))
    # The same options after the action; SUPPRESS so that, absent there, they keep the above.
    common = argparse.ArgumentParser(add_help=False)
    _add_server_options(common, argparse.SUPPRESS, argparse.SUPPRESS)
    actions = parser.add_subparsers(dest="action", required=True)
    load = actions.add_parser("load", parents=[common], help="load a PEFT adapter folder under NAME")
    load.add_argument("name")
    load.add_argument("path", help="the adapter folder on the server's disk (a relative path is made absolute here)")
    unload = actions.add_parser("unload", parents=[common], help="unload adapter NAME (refused while requests use it)")
    unload.add_argument("name")
    actions.add_parser("list", parents=[common], help="the loaded adapters")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``pagoda lora``; returns the exit code."""
    args = make_parser().parse_args(argv)
    path = getattr(args, "path", None)
    if path is not None and not path.startswith("/"):
        path = str(Path(path).resolve())
    try:
        answer = lora_control(args.url, args.action, getattr(args, "name", None), path, args.api_key)
    except LoRAControlError as exc:
        print(f"pagoda lora {args.action}: {exc}", file=sys.stderr)
        return 1
    loaded = ", ".join(answer.get("loaded", [])) or "none"
    if args.action == "load":
        print(f"loaded {answer.get('lora_name')!r} from {answer.get('lora_path')}; adapters now: {loaded}")
    elif args.action == "unload":
        print(f"unloaded {answer.get('lora_name')!r}; adapters now: {loaded}")
    else:
        paths = answer.get("paths") or {}
        for name in answer.get("loaded", []):
            print(f"{name}\t{paths.get(name, '')}".rstrip())
        if not answer.get("loaded"):
            print("no LoRA adapters loaded", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
