"""Sphinx configuration: MyST pages, the notebooks executed by myst-nb at build time, and the
reference generated from the code (_ext/elastic_nb_docs.py). `make docs` builds it with every
warning an error (a broken link, a notebook cell that raises unless tagged to)."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))
sys.path.insert(0, str(HERE.parent))

project = "elastic_nb"
author = "the elastic_nb engineers"
copyright = "2026, the elastic_nb engineers"

extensions = ["myst_nb", "sphinx.ext.autodoc", "elastic_nb_docs"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
exclude_patterns = ["_build", "**/.ipynb_checkpoints", "**/.elastic_nb_checkpoints"]

# The notebooks (tutorials/, links to notebooks/) run at every build, each in a directory of its
# own, on CPU: a cell that raises fails the build unless it is tagged `raises-exception`.
nb_execution_mode = "force"
nb_execution_in_temp = True
nb_execution_timeout = 600
nb_execution_raise_on_error = True
nb_execution_show_tb = True
# A cell's error is elastic_nb's report (the rank that failed first, every rank's story), not a
# Python traceback for the IPython lexer.
nb_render_error_lexer = "text"
autodoc_member_order = "bysource"
autodoc_typehints = "signature"

html_theme = "furo"
html_title = "elastic_nb"
html_static_path = ["_static"]
html_css_files = ["elastic_nb.css"]
smartquotes = False  # '--nproc' stays two hyphens, as a user types it
