"""What is known of a registered model before its weights load: its attention head dimensions and how many
tokens its tokenizer makes of the calibration and evaluation text.

harness/validate.py asks these to stop bad input in seconds instead of after a 50-100 s load. A GGUF's head
dimensions come from its metadata header alone (`gguf_metadata`: the tensors are never read; the `gguf`
package's reader builds every tensor's description and takes 5-20 s on these files). A GGUF's tokenizer, which
transformers converts in 5-50 s, is converted once and kept in the disk cache (harness.models.gguf_tokenizer, as
the model load reads it), and token counts are cached per
model, text and transformers version.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import struct
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer

from harness.capacity import shape_from_config
from harness.io import cache_root, write_json_atomic
from harness.models import (
    ModelUnavailable,
    byte_tokenizer,
    gguf_path,
    gguf_tokenizer,
    hf_folder,
    model_spec,
    spec_identity,
)

GGUF_MAGIC = b"GGUF"
# GGUF value types (ggml's gguf.h): id -> struct format of one scalar; 8 = string, 9 = array.
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9


def _read_value(buf, pos: int, kind: int, keep: bool):
    """(value or None when not kept, position after it) of one GGUF value of type `kind` at buf[pos:]."""
    if kind in SCALARS:
        fmt = "<" + SCALARS[kind]
        return (struct.unpack_from(fmt, buf, pos)[0] if keep else None), pos + struct.calcsize(fmt)
    if kind == STRING:
        (n,) = struct.unpack_from("<Q", buf, pos)
        return (bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8", "replace") if keep else None), pos + 8 + n
    if kind == ARRAY:
        item, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if item in SCALARS and not keep:  # fixed-size items: skipped without a loop
            return None, pos + count * struct.calcsize(SCALARS[item])
        values = []
        for _ in range(count):  # strings (a tokenizer's vocabulary) are skipped one length at a time
            value, pos = _read_value(buf, pos, item, keep)
            values.append(value)
        return (values if keep else None), pos
    raise ValueError(f"unknown GGUF value type {kind}")


def gguf_metadata(path: str | Path, keep=lambda key: True) -> dict:
    """The key-value metadata of a GGUF file (version 2 or 3, little-endian) whose key satisfies `keep`.

    Reads only the header: the tensors that follow are not touched.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != GGUF_MAGIC:
            raise ValueError(f"{path}: not a GGUF file")
        version, _, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version}; readable: 2, 3 (little-endian)")
        pos, out = 24, {}
        for _ in range(n_kv):
            (n,) = struct.unpack_from("<Q", buf, pos)
            key = bytes(buf[pos + 8 : pos + 8 + n]).decode()
            (kind,) = struct.unpack_from("<I", buf, pos + 8 + n)
            wanted = keep(key)
            value, pos = _read_value(buf, pos + 12 + n, kind, wanted)
            if wanted:
                out[key] = value
    return out


def gguf_head_dims(path: str | Path) -> set[int]:
    """Key and value head dimensions from a GGUF's metadata (`<arch>.attention.key_length` / `value_length`,
    else embedding_length / head_count, as llama.cpp and transformers read them)."""
    meta = gguf_metadata(path, keep=lambda key: key == "general.architecture" or ".attention." in key
                         or key.endswith(".embedding_length"))  # fmt: skip
    arch = meta["general.architecture"]
    heads = meta[f"{arch}.attention.head_count"]
    heads = max(heads) if isinstance(heads, list) else heads  # per-layer counts in some files
    fallback = meta[f"{arch}.embedding_length"] // heads
    return {
        meta.get(f"{arch}.attention.key_length", fallback),
        meta.get(f"{arch}.attention.value_length", fallback),
    }


def _config(spec: dict):
    """The transformers config of a tiny or hf registry entry (no weights are read)."""
    if spec["source"] == "tiny":
        return AutoConfig.for_model(spec["arch"], **spec["config"])
    try:
        return AutoConfig.from_pretrained(hf_folder(spec), local_files_only=True)
    except OSError as err:
        raise ModelUnavailable(
            f"model {spec['name']}: weights of {spec.get('path') or spec['hf_id']} are not on this machine; "
            f"{spec['install']}"
        ) from err


def head_dims(name: str) -> set[int]:
    """Every head dimension a KV cache of the registered model stores (several when layers differ)."""
    spec = model_spec(name)
    if spec["source"] == "gguf_package":
        return gguf_head_dims(gguf_path(spec))

    shape = shape_from_config(_config(spec), name)
    return {layer.head_dim for layer in shape.layers if layer.cached}


def tokenizer(name: str):
    """The registered model's tokenizer alone, as harness.models.load_model builds it."""
    spec = model_spec(name)
    if spec["source"] == "tiny":
        return byte_tokenizer()
    if spec["source"] == "gguf_package":
        return gguf_tokenizer(name, gguf_path(spec))

    try:
        return AutoTokenizer.from_pretrained(hf_folder(spec), local_files_only=True)
    except OSError as err:
        raise ModelUnavailable(
            f"model {spec['name']}: tokenizer of {spec.get('path') or spec['hf_id']} is not on this machine; "
            f"{spec['install']}"
        ) from err


def token_counts(name: str, texts: dict[str, str]) -> dict[str, int]:
    """Tokens the model's tokenizer makes of each text (no special tokens, as harness.data cuts windows).

    Cached on disk under the model's registry entry, the texts and the transformers version: the first call
    for a text loads the tokenizer (seconds), later ones read a small JSON.
    """
    digest = hashlib.sha256(spec_identity(name).encode())
    for split in sorted(texts):
        digest.update(split.encode() + b"\0" + texts[split].encode() + b"\0")
    path = cache_root() / "token_counts" / f"{name}-{digest.hexdigest()[:20]}.json"
    if path.exists():
        return json.loads(path.read_text())
    tok = tokenizer(name)
    counts = {split: len(tok(text, add_special_tokens=False)["input_ids"]) for split, text in texts.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, counts)
    return counts
