"""`python -m elastic_nb join|runs|logs`: the `elastic-nb` command (cli.py)."""

import sys

from elastic_nb.cli import main

if __name__ == "__main__":
    sys.exit(main())
