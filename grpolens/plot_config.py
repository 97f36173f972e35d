"""The plotly.js ``config`` of every chart grpolens draws (dashboard and HTML reports).

plotly.js (v4 as bundled by plotly 7) shows a "Share chart" mode-bar button by default
(``showSendToCloud``): one confirm click posts the figure, with prompt- and completion-derived
content, to Plotly's cloud. grpolens never sends data off the machine, so every chart turns the
button off, removes it by name, and leaves no upload URL for it to use.
"""

from __future__ import annotations

from typing import Any

#: Mode-bar buttons that send a chart or its data to a remote server.
UPLOAD_BUTTONS = ("sendChartToCloud", "sendDataToCloud", "editInChartStudio")


def plot_config(**extra: Any) -> dict[str, Any]:
    """A fresh plotly.js config with every upload path disabled (``extra`` adds other settings)."""
    return {
        "displaylogo": False,
        "showSendToCloud": False,
        "plotlyServerURL": "",
        "modeBarButtonsToRemove": list(UPLOAD_BUTTONS),
        **extra,
    }
