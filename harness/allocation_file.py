"""An allocation and the scheme that stores it, as one JSON file: what `python -m harness.export` writes from a
recorded point and one's own code reads back (harness.load_allocation) to build a cache.

The file: {"format": FORMAT, "scheme": the scheme's point fields (harness.schemes.point_fields), "allocation":
Allocation.to_dict(), "source": free-form provenance (run, point key, model, commit, metrics)}.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from harness.io import write_json_atomic
from harness.policies import Allocation
from harness.schemes import Scheme, from_point, point_fields

FORMAT = "kvbits-allocation/1"


def save_allocation(path: str | Path, allocation: Allocation, scheme: Scheme | str, **source) -> Path:
    """Write `allocation` and `scheme` (an object, or a name with default options) to `path` atomically; `source`:
    anything worth keeping beside them (where they came from)."""
    scheme = from_point({"scheme": scheme}) if isinstance(scheme, str) else scheme
    record = {
        "format": FORMAT,
        "scheme": point_fields(scheme),
        "allocation": allocation.to_dict(),
        "source": source,
    }
    return write_json_atomic(path, record)


def load_allocation(path: str | Path) -> tuple[Allocation, Scheme]:
    """(allocation, scheme) of a file save_allocation wrote; ValueError naming `path` for anything else."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"path: cannot read an allocation from {path} ({type(err).__name__})") from None
    if not isinstance(record, Mapping) or record.get("format") != FORMAT:
        raise ValueError(f"path: {path} is not an allocation file (format {FORMAT})")
    try:
        return Allocation.from_dict(record["allocation"]), from_point(record["scheme"])
    except (ValueError, TypeError, KeyError) as err:
        raise ValueError(f"path: {path}: {str(err).splitlines()[0]}") from None
