"""Print pip constraints that pin every dependency the package declares to its floor.

`make floors` installs exactly these and runs a smoke subset of the suite on them, so a floor in
pyproject.toml (`name>=X`) cannot claim a version the code no longer works with.
"""

import re
import sys
from pathlib import Path

import tomllib

root = Path(__file__).resolve().parent.parent
declared = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
for requirement in declared:
    match = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*>=\s*([0-9][0-9A-Za-z.]*)\s*", requirement)
    if not match:
        sys.exit(
            f"floors.py: {requirement!r} is not 'name>=version'; every dependency needs a floor"
        )
    print(f"{match[1]}=={match[2]}")
