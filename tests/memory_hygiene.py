"""Memory between tests: what a test dropped is freed when the test ends, not minutes later.

Why: test objects that are reference cycles (fixtures, tracebacks, torch modules, what a
library builds) are freed only by CPython's full collection, which the test process's heap
(~300k objects once torch and transformers are imported) makes both rare and slow (~1 s).
An ``LLMEngine`` was one (its parts kept bound methods and closures of one another: the beam
search's stop-string finder, the input processor's capability checks, the scheduler's
callbacks), so its weights and KV cache (the 512 MiB CPU default) waited for that collection:
tests/engine/test_admission.py took the process from 0.5 to 3.3 GB resident, the first seven
modules of tests/engine to 6.2 GB, and a pytest-xdist worker running a share of the suite to
~9.5 GB (two of them overran 24 GiB). The engine is no cycle any more (its callbacks hold the
parts they read; tests/engine/test_engine_freed.py checks that a dropped engine and ``LLM``
free their KV cache with the collector off), but a test can still keep one alive through a
cycle of its own (an exception's traceback, a fixture's closure), and other heavy objects are
cyclic; these measures stay for them.

How: when collection has imported every test module, the survivors of a full collection are
frozen (``gc.freeze``: the cycle collector no longer walks them), so a later full collection
walks only what was made since. After a test has run (torn down, and its fixture values
dropped by pytest: they are still held during the teardown hooks) one runs when the process
grew by ``GROWTH_BYTES`` since the last: a test that built an engine always does, the many
small tests don't pay the ~10-200 ms a collection takes while a module's own imports are not
frozen yet. When a module ends (its fixtures torn down) one always runs and the survivors are
frozen again, so the objects of a library one module imported are not walked by later ones,
and glibc is asked to hand its free heap pages back (``malloc_trim``): it keeps what torch
frees in its heaps, so a process that freed a float64 transformers model and an engine
twice stayed at 1.74 GB resident, 0.54 GB after the trim.

Invariant: only objects that survived a full collection are frozen, and never a fixture value
a test still holds (that would keep a module fixture's engine for good). Freezing hides an object
from the cycle collector only: one whose count drops to zero is still freed at once; a frozen
object that later becomes cyclic garbage stays (session fixtures, module globals: alive
until the end anyway).
"""

from __future__ import annotations

import ctypes
import gc
import os

GROWTH_BYTES = 128 * 2**20  # resident growth since the last collection that triggers one after a test
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_since = {"rss": None}  # resident bytes right after the last collection (None: not measured yet)


def _resident_bytes():
    """This process's resident bytes (``/proc/self/statm``), or None where there is no /proc."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def _malloc_trim():
    """glibc's ``malloc_trim``, or None (another C library)."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()


def _collect(trim: bool = False) -> None:
    gc.collect()
    if trim and _TRIM is not None:
        _TRIM(0)
    _since["rss"] = _resident_bytes()


def freeze_survivors() -> None:
    """Collect everything, hand free heap pages back, then freeze what is left (alive) out
    of later collections."""
    _collect(trim=True)
    gc.freeze()


def after_test(item, nextitem) -> None:
    """After ``item`` ran (torn down, its fixture values dropped): at its module's end collect
    and freeze the survivors; else
    collect if the process grew by ``GROWTH_BYTES`` since the last collection."""
    if nextitem is None or nextitem.path != item.path:
        freeze_survivors()
        return
    rss, last = _resident_bytes(), _since["rss"]
    if rss is None or last is None or rss - last >= GROWTH_BYTES:
        _collect()
    elif rss < last:
        _since["rss"] = rss  # freed without a collection: grow from here
