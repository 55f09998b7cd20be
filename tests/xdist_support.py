"""Running the suite under pytest-xdist (``-n 2 --dist loadgroup``) without building anything twice.

Optional: the README's command runs the suite in one process. Under xdist every worker
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
