"""The live dashboard under a %%elastic cell (ipywidgets, via anywidget).

`model` folds the supervisor's updates into bounded, plain data; `widget` sends that data to the
browser, one message per update; ``static/`` draws it. Importing this package imports ipywidgets
and anywidget: only the kernel does, and only when a frontend shows widgets.
"""

from __future__ import annotations

from elastic_nb.kernel.dashboard.widget import Dashboard, DashboardWidget

__all__ = ["Dashboard", "DashboardWidget"]
