"""The on-disk cache of everything fitted on calibration windows (entropy tables, key tables, transforms, unit-error
tables): `disk_cached` keys a table by an identity text and the windows' tokens, and `model_identity` and
`source_identity` say what that identity holds about the model and the calibration text.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pandas as pd
import torch

from harness.data import DEFAULT_CORPUS, source_name
from harness.io import cache_root, write_parquet_atomic


def model_identity(model, model_name: str) -> str:
    """What a table cached on disk depends on about the model: its name, its config, and its dtype when that is
    not float32 (float32 tables keep the identity they had before the dtype was recorded)."""
    dtype = str(model.dtype).removeprefix("torch.")
    return f"{model_name}|{model.config.to_json_string()}" + ("" if dtype == "float32" else f"|{dtype}")


def source_identity(source: str | None) -> str:
    """What a table cached on disk adds to its identity about the calibration source its windows were cut from
    (harness.data): nothing for the default corpus (so tables cached before sources had names keep their keys),
    else '|calibration=' and the source's name. The windows' tokens are part of every key as well."""
    return "" if source in (None, DEFAULT_CORPUS) else f"|calibration={source_name(source)}"


def cache_dir() -> Path:
    return cache_root() / "calibration"


def disk_cached(stem: str, identity: str, input_ids: torch.Tensor, compute) -> pd.DataFrame:
    """compute(), read from cache_dir()/<stem>-<key>.parquet when the same identity text and input_ids (C, T)
    were seen before; a new table is written atomically."""
    key = hashlib.sha256(identity.encode() + input_ids.numpy().tobytes()).hexdigest()[:20]
    path = cache_dir() / f"{stem}-{key}.parquet"
    if path.exists():
        return pd.read_parquet(path)
    table = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_parquet_atomic(path, table)
    return table
