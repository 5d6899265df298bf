"""`python -m elastic_nb.launcher FD`: the zygote, which forks launchers (zygote.py) that run one
job each (agent.py). A package ``__main__``, so spawn and forkserver children never re-import it."""

import sys

from elastic_nb.launcher.zygote import main

if __name__ == "__main__":
    main(int(sys.argv[1]))
