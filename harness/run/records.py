"""A run directory's points/: one JSON per finished point, written atomically, and the resume rule.

A point's file is written once the point is done, so a run killed at any moment (SIGKILL included) resumes with
no point lost or repeated: a point whose file exists is done. The grid names a point by its config hash
(harness.config.Point.key), passkey by its readable name (harness.protocols.passkey.point_name).
"""

from __future__ import annotations

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
        return write_json_atomic(self.path(key), record)
