"""fxamp's graphs and measurements in Google's Model Explorer (docs/explain.md, "In a graph
viewer"): the conversion is plain data (graph.py, overlays.py, document.py); serving it needs
the optional package (`pip install "fxamp[viewer]"`, server.py)."""

from fxamp.viewer.document import GraphView, graph_view
from fxamp.viewer.server import Viewer, ViewerMissing, serve, show

__all__ = ["GraphView", "graph_view", "Viewer", "ViewerMissing", "serve", "show"]
