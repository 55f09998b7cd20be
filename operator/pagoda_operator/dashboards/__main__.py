"""``python -m pagoda_operator.dashboards [--out DIR] [--check]``: write (or check) the dashboards.

Writes ``<uid>.json`` for every board of ``BOARDS`` to ``charts/pagoda/dashboards`` (the
chart's ConfigMaps read them); ``--check`` writes nothing and exits 1 naming any file that
differs from what the code generates.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pagoda_operator.dashboards import fleet, operator_view, replica
from pagoda_operator.dashboards.panels import Board, to_json

BOARDS = (replica.board, fleet.board, operator_view.board)
DEFAULT_OUT = Path(__file__).resolve().parents[3] / "charts" / "pagoda" / "dashboards"


def generated() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    boards: list[Board] = [make() for make in BOARDS]
    return {f"{b.uid}.json": to_json(b) for b in boards}


def main(argv: list[str] | None = None) -> int:
    """Write or check the dashboards. Returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m pagoda_operator.dashboards", description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder (default: %(default)s)")
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    args = parser.parse_args(argv)
    stale = []
    for name, text in generated().items():
        path = args.out / name
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path))
            continue
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    if stale:
        print("out of date (run python -m pagoda_operator.dashboards): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
