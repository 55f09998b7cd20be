"""Process lifetime for ``pagoda serve``: no server outlives its launcher, no stub its server.

Three processes make a replica: the launcher (``pagoda serve``), ``tritonserver`` (its
child, in its own process group so a terminal's Ctrl-C reaches only the launcher, which
then drains), and the Python-backend stub (tritonserver's child, same process group; it
runs the engine and the fleet publisher's heartbeat). Each link is guarded:

- launcher -> tritonserver: the child is started with a parent-death signal
  (``prctl(PR_SET_PDEATHSIG, SIGKILL)``, Linux), so a SIGKILLed or OOM-killed launcher
  takes the server with it and the ports are free for the next start. Linux sends the
  signal when the *thread* that forked the child exits, so ``spawn`` forks from one
  long-lived spawner thread: a server started from a short-lived thread (a benchmark's
  worker, a test's thread pool) does not die when that thread ends.
- tritonserver -> stub: the stub cannot be given a parent-death signal (tritonserver
  forks it), so ``ParentWatch`` inside the stub polls ``os.getppid()`` and ends the
  process the moment it is reparented; its Redis heartbeat then stops and expires.
- the launcher's stop kills the whole process group (``kill_group``) even when
  tritonserver is already gone, so a stub can never be left behind by a clean stop.
- a killed server leaves its stubs' shared-memory regions in ``/dev/shm`` (tritonserver
  unlinks them only on a clean exit); each server names its regions with its own prefix,
  and the launcher's stop removes them (``remove_shm_regions``); a launcher that was itself
  killed cannot, so each start first removes pagoda's regions no process maps any more
  (``sweep_orphan_shm_regions``). Left there, they fill a container's small ``/dev/shm``
  (64 MiB in Docker) until a stub dies of SIGBUS mid-request.

Everything here reads ``/proc``; on other systems the guards degrade to no-ops.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
# What an orphaned Python-backend stub logs as it exits (model.py); the launcher reads it to
# tell "tritonserver died, then its stub" from "the stub died, then tritonserver aborted".
ORPHANED_STUB_MESSAGE = "tritonserver died; the Python-backend stub exits"


def _prctl() -> Optional[Callable[..., int]]:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()  # resolved here: a forked child must not load libraries


def set_parent_death_signal(signum: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``signum`` to this process when its parent thread exits.

    Returns:
        True if set; False where ``prctl`` is unavailable (not Linux).
    """
    return _PRCTL is not None and _PRCTL(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0


def make_preexec(parent_pid: int) -> Callable[[], None]:
    """A ``preexec_fn`` that gives the child a parent-death SIGKILL.

    If the parent died between ``fork`` and ``prctl`` the signal would never come, so the
    child checks its parent id afterwards and exits at once in that case.
    """

    def preexec() -> None:
        set_parent_death_signal(signal.SIGKILL)
        if os.getppid() != parent_pid:
            os._exit(1)

    return preexec


# One thread, alive as long as the process, forks every guarded child (see module doc).
_SPAWNER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagoda-spawner")


def spawn(command: list[str], **popen_kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen(command, **popen_kwargs)`` with a parent-death SIGKILL, forked
    from the long-lived spawner thread; raises what ``Popen`` raises."""
    parent_pid = os.getpid()
    return _SPAWNER.submit(subprocess.Popen, command, preexec_fn=make_preexec(parent_pid), **popen_kwargs).result()


def _stat_fields(pid: int) -> Optional[list[str]]:
    """Fields of ``/proc/<pid>/stat`` after the command name (state is [0], pgrp [2])."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    return text[text.rfind(")") + 2:].split()


def is_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (exited, not yet reaped)."""
    fields = _stat_fields(pid)
    if fields is None:
        return False
    return fields[0] not in ("Z", "X")


def process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def python_stubs(pgid: int, model_name: str) -> list[int]:
    """Live Python-backend stubs in process group ``pgid`` that serve ``model_name`` (a stub's
    command line holds its model's ``<repository>/<model>/<version>/model.py``)."""
    stubs = []
    for pid in group_members(pgid):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if process_name(pid).startswith("triton_python") and len(args) > 1 and \
                Path(args[1].decode(errors="replace")).parts[-3:-2] == (model_name,):
            stubs.append(pid)
    return stubs


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid``."""
    members = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is not None and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def kill_group(pgid: int, timeout_s: float = 5.0) -> list[int]:
    """SIGKILL every process in group ``pgid`` and wait until none is left alive.

    Returns:
        Pids still alive after ``timeout_s`` (empty on success).
    """
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return []
    except PermissionError:
        logger.warning("cannot signal process group %d", pgid)
    deadline = time.monotonic() + timeout_s
    while True:
        left = group_members(pgid)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def remove_shm_regions(prefix: str, shm_dir: Path = Path("/dev/shm")) -> int:
    """Unlink the shared-memory regions named ``prefix*`` (one server's); returns how many."""
    return sum(_unlink(region) for region in shm_dir.glob(f"{prefix}*")) if prefix else 0


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except OSError:
        return False


def _mapped_files() -> set[str]:
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(line.split(None, 5)[5].strip() for line in maps.read_text().splitlines()
                          if line.count(" ") >= 5 and "/" in line)
        except (OSError, IndexError):
            continue
    return mapped


def sweep_orphan_shm_regions(prefix: str = "pagoda_", shm_dir: Path = Path("/dev/shm"), min_age_s: float = 60.0) -> int:
    """Unlink ``prefix*`` regions older than ``min_age_s`` that no process maps (their server
    was killed with its launcher); returns how many. A region being created is young."""
    old = [r for r in shm_dir.glob(f"{prefix}*") if time.time() - _mtime(r) >= min_age_s]
    if not old:
        return 0
    mapped = _mapped_files()
    return sum(_unlink(region) for region in old if str(region) not in mapped)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return time.time()


def check_ports_free(ports: Iterable[int], host: str = "0.0.0.0") -> None:
    """Refuse to start when a port is taken (tritonserver would die with a terse bind error).

    Raises:
        RuntimeError: naming the port, and the process holding it when /proc tells.
    """
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                raise RuntimeError(f"port {port} is already in use{_holder(port)}; stop that process or "
                                   "choose another port (--http-port/--grpc-port/--metrics-port)") from None


def _holder(port: int) -> str:
    """`` (held by pid N, name)`` for a listening TCP port, or "" when /proc cannot tell."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) > 9 and parts[3] == "0A" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(parts[9])
    if not inodes:
        return ""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        if any(f"socket:[{inode}]" in _fd_links(entry) for inode in inodes):
            return f" (held by pid {entry.name}, {process_name(int(entry.name))})"
    return ""


def _fd_links(proc_dir: Path) -> set[str]:
    """What a process's file descriptors point at (empty where we may not look)."""
    links = set()
    try:
        fds = list((proc_dir / "fd").iterdir())
    except OSError:
        return links
    for fd in fds:
        try:
            links.add(os.readlink(fd))
        except OSError:  # closed meanwhile (the listing's own descriptor, for one)
            pass
    return links


class PollingWatch:
    """Calls ``action`` once, on a daemon thread, as soon as ``condition()`` is true (polled
    every ``interval_s``). ``stop()`` ends the watch and joins its thread, unless called from
    that thread (an action may stop its own watch)."""

    def __init__(self, condition: Callable[[], bool], action: Callable[[], None], name: str,
                 interval_s: float) -> None:
        self._condition = condition
        self._action = action
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> "PollingWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5.0)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            if self._condition():
                self._action()
                return


class ParentWatch(PollingWatch):
    """Calls ``on_orphaned`` once if this process is reparented (its parent died).

    Args:
        on_orphaned: what to do then; the stub passes a function that ends the process.
        interval_s: polling period.
    """

    def __init__(self, on_orphaned: Callable[[], None], interval_s: float = 0.25) -> None:
        parent_pid = os.getppid()

        def orphaned() -> None:
            logger.error("parent process %d is gone; this process ends with it", parent_pid)
            on_orphaned()

        super().__init__(lambda: os.getppid() != parent_pid, orphaned, "pagoda-parent-watch", interval_s)
