"""The offline progress bar: ``LLM.generate(..., use_tqdm=True)``, as vLLM's.

One bar per ``generate`` call over many prompts: finished prompts out of all, with the
input and output token rates so far (``est. speed input: ... toks/s, output: ... toks/s``).
It is drawn by ``tqdm`` on stderr and only by the offline API: servers run the engine
through ``serving/engine_loop.py`` and never make one, so no bar reaches a server's logs.

``use_tqdm`` is ``True`` (tqdm's own bar), ``False`` (none: ``NoProgress``), or a callable
with tqdm's signature (``total``, ``desc``, ``unit``, ``dynamic_ncols``) for another bar
(``tqdm.notebook.tqdm``, a test's recorder), as vLLM accepts.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Union

from pagoda.engine.outputs import RequestOutput

UseTqdm = Union[bool, Callable[..., Any]]


class NoProgress:
    """The bar when ``use_tqdm`` is False: every call does nothing."""

    def finished(self, output: RequestOutput) -> None:
        """Nothing to draw."""

    def close(self) -> None:
        """Nothing to close."""


class Progress:
    """A tqdm bar counting finished prompts, with token rates in its postfix.

    Args:
        total: the number of prompts.
        use_tqdm: True (``tqdm.auto.tqdm``) or a tqdm-like callable.
        clock: seconds, for the rates (``time.perf_counter``).
    """

    def __init__(self, total: int, use_tqdm: UseTqdm = True, clock: Callable[[], float] = time.perf_counter) -> None:
        if use_tqdm is True:
            from tqdm.auto import tqdm as use_tqdm
        self.bar = use_tqdm(total=total, desc="Processed prompts", unit="prompt", dynamic_ncols=True)
        self.clock = clock
        self.started = clock()
        self.num_input_tokens = 0
        self.num_output_tokens = 0

    def finished(self, output: RequestOutput) -> None:
        """Count one finished prompt (all its completions' tokens) and refresh the rates."""
        self.num_input_tokens += len(output.prompt_token_ids or ())
        self.num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
        elapsed = max(self.clock() - self.started, 1e-9)
        self.bar.postfix = (f"est. speed input: {self.num_input_tokens / elapsed:.2f} toks/s, "
                            f"output: {self.num_output_tokens / elapsed:.2f} toks/s")
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def make_progress(total: int, use_tqdm: UseTqdm) -> Union[Progress, NoProgress]:
    """The bar ``generate`` draws for ``total`` prompts.

    Args:
        total: the number of prompts.
        use_tqdm: True, False, or a tqdm-like callable.

    Returns:
        A ``Progress`` (or ``NoProgress`` when ``use_tqdm`` is False).

    Raises:
        ValueError: ``use_tqdm`` is neither a bool nor callable.
    """
    if use_tqdm is False:
        return NoProgress()
    if use_tqdm is not True and not callable(use_tqdm):
        raise ValueError(f"use_tqdm: must be True, False or a tqdm-like callable, got {use_tqdm!r}")
    return Progress(total, use_tqdm)
