"""Execute a notebook headlessly (a real kernel, via nbclient) and print every cell's output.

    python scripts/run_notebook.py notebooks/quickstart.ipynb

Exits non-zero when a cell raises, except cells tagged ``raises-exception``.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def print_cell(index: int, cell: nbformat.NotebookNode) -> None:
    first = cell.source.splitlines()[0] if cell.source else ""
    print(f"\n### cell {index}: {first}")
    for out in cell.get("outputs", ()):
        if out.output_type == "stream":
            sys.stdout.write(out.text)
        elif out.output_type in ("execute_result", "display_data"):
            text = out.data.get("text/plain")
            if text is not None:
                print(f"Out: {text}")
        elif out.output_type == "error":
            print("\n".join(_ANSI.sub("", line) for line in out.traceback))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("notebook", type=Path)
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    args = parser.parse_args()
    nb = nbformat.read(args.notebook, as_version=4)
    client = NotebookClient(
        nb,
        timeout=args.timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(args.notebook.parent.resolve())}},
    )
    t0 = time.monotonic()
    failed = None
    try:
        client.execute()
    except CellExecutionError as e:
        failed = e
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            print_cell(index, cell)
    print(f"\n{args.notebook}: {'FAILED' if failed else 'ok'} in {time.monotonic() - t0:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
