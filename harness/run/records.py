"""A run directory's points/: one JSON per finished point, written atomically, and the resume rule.

A point's file is written once the point is done, so a run killed at any moment (SIGKILL included) resumes with
no point lost or repeated: a point whose file exists is done. The grid names a point by its config hash
(harness.config.Point.key), passkey by its readable name (harness.protocols.passkey.point_name).

A point that takes hours (passkey's at 8K: every trial its own prefill) may also keep partial/KEY.json beside
points/: what it has done so far, rewritten atomically as it goes and removed once its point file is written, so
that a run stopped inside the point resumes from there (what a partial holds is its protocol's).
"""

from __future__ import annotations

import json
from pathlib import Path

from harness.io import write_json_atomic


class PointLog:
    """The points/ folder of one run directory."""

    def __init__(self, run_dir: str | Path):
        self.folder = Path(run_dir) / "points"
        self.folder.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        return self.folder / f"{key}.json"

    def done(self, key: str) -> bool:
        return self.path(key).exists()

    def write(self, key: str, record: dict) -> Path:
        """Write the finished point `key` and drop its partial."""
        path = write_json_atomic(self.path(key), record)
        self.partial_path(key).unlink(missing_ok=True)
        return path

    def partial_path(self, key: str) -> Path:
        return self.folder.parent / "partial" / f"{key}.json"

    def read_partial(self, key: str) -> dict | None:
        """The partial of the unfinished point `key`, or None if it has none."""
        path = self.partial_path(key)
        return json.loads(path.read_text()) if path.exists() else None

    def write_partial(self, key: str, partial: dict) -> Path:
        self.partial_path(key).parent.mkdir(exist_ok=True)
        return write_json_atomic(self.partial_path(key), partial)
