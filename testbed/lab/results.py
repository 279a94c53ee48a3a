"""Where benchmark and evaluation results go: JSON files, written the same way by every tool."""
from __future__ import annotations

import json
from pathlib import Path


def write_json(path: str | Path | None, result: dict) -> None:
    """Write ``result`` to ``path`` (parents made), if a path is given."""
    if not path:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
