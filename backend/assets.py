"""Files the backend serves or embeds that come from installed packages (plotly.min.js).

Owned here, below the routes, so that both the page routes and the offline run report
(``backend.report.html``) find them without one importing the other.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["plotly_js_path"]


def plotly_js_path() -> Path:
    """Where the installed plotly package keeps plotly.min.js (RuntimeError if absent)."""
    spec = importlib.util.find_spec("plotly")
    if spec is None or not spec.origin:
        raise RuntimeError("The plotly package is not installed; pip install 'torch-rebalancer[server]'.")
    path = Path(spec.origin).parent / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise RuntimeError(f"plotly.min.js is missing from the plotly package (looked at {path}).")
    return path
