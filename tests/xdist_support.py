"""Running the suite under pytest-xdist (``-n 2 --dist loadgroup``) without building anything twice.

The README's command (and so CI's) runs the suite in two workers; ``-n 0`` runs it in one
process. Under xdist every worker
collects every test and runs only those the controller sends it, so:

- **groups.** A test goes with the others of its module (its module fixtures are built once,
  its tests keep their order), and every test using one of ``SHARED_SERVERS`` (the session
  tritonserver, the package's ``pagoda serve`` with its OpenAI door) goes to one worker, so
  each of those starts once, as in a serial run. xdist's own ``xdist_group`` marks do not
  work with pytest 9.2 (xdist 3.8 appends the group to ``item._nodeid``, which pytest 9.2 no
  longer reads: pytest-dev/pytest-xdist#1386), so each worker writes its tests' groups into
  ``groups-<worker>.json`` in the controller's folder (``workerinput["pagoda_xdist_dir"]``)
  when it has collected, and the controller's scheduler (``GroupScheduling``, xdist's
  loadgroup scheduler with another ``_split_scope``) reads them: xdist schedules only after
  every worker has reported its collection, i.e. after every file was written.
- **the sm_90 compile runs** (tests/kernels/sm90_runs.py) belong to the controller: it starts
  them once its first worker has collected, writes each family's output into the same folder,
  and removes the folder when the session ends.
- **threads.** Each worker's torch, and what it starts (tritonserver's stubs, bench and
  parallel workers, which read ``OMP_NUM_THREADS``), gets ``cores / workers`` intra-op threads
  (at least one), not every core: two workers of two threads each on two cores spin at each
  other's OpenMP barriers (an ``-n 2`` run spent as much CPU as the serial one while compiling
  a third of the sm_90 variants). A test that needs its own count sets it (``restore_threads``).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Optional

SHARED_SERVERS = ("triton_server", "openai_serve")
FOLDER_KEY = "pagoda_xdist_dir"


def group_of(item) -> str:
    """The shared server ``item`` uses (``SHARED_SERVERS``, first match), else its module's path."""
    used = [name for name in SHARED_SERVERS if name in getattr(item, "fixturenames", ())]
    return used[0] if used else item.nodeid.split("::")[0]


def write_groups(config, items) -> None:
    """A worker's ``{nodeid: group}``, written whole (``os.replace``) for the controller."""
    folder = config.workerinput.get(FOLDER_KEY)
    if folder is None:
        return
    path = Path(folder) / f"groups-{config.workerinput['workerid']}.json"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({item.nodeid: group_of(item) for item in items}))
    os.replace(tmp, path)


def share_cores(config) -> None:
    """A worker's intra-op threads: the cores (its affinity) over the workers, at least one; also
    ``OMP_NUM_THREADS`` for the processes it starts (unless the user set it)."""
    import torch

    workers = int(config.workerinput.get("workercount", 1))
    threads = max(1, len(os.sched_getaffinity(0)) // workers)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def controller_folder(config) -> str:
    """The controller's folder for the workers' groups and the sm_90 runs' outputs (made once)."""
    if not hasattr(config, "_pagoda_xdist_dir"):
        config._pagoda_xdist_dir = tempfile.mkdtemp(prefix="pagoda-xdist-")
    return config._pagoda_xdist_dir


def make_scheduler(config, log) -> Optional[object]:
    """``GroupScheduling`` for ``--dist loadgroup``; None (xdist's own) for any other mode."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class GroupScheduling(LoadGroupScheduling):
        """xdist's loadgroup scheduler, the groups read from the workers' files."""

        groups: Optional[dict[str, str]] = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:
                self.groups = {}
                for path in sorted(Path(controller_folder(config)).glob("groups-*.json")):
                    self.groups.update(json.loads(path.read_text()))
            return self.groups.get(nodeid) or super()._split_scope(nodeid)

    return GroupScheduling(config, log)
