"""`python -m kernels.gpu.trim_wheel WHEEL`: a transformers wheel rewritten in place without the model packages that
neither the harness's models nor transformers' own code outside `transformers/models/` reach.

This module owns that trim, for `make gpu-wheels`: a device call carries the working tree and `.whl/` within 64 MiB,
and the tracked tree (about 53 MB, most of it results/) leaves less room than transformers' 13 MB wheel needs beside
the other wheels. Most of that wheel is the code of some five hundred model families loaded lazily by name, of which
the GPU check builds a few (tiny Llama, GPT-2 and Gemma models). Kept: KEEP, every model package that a file outside
`transformers/models/` names (the GGUF tokenizer mapping imports some at import time), and what the kept ones
import in turn (`from ..NAME` or `models.NAME`), to closure. The wheel's RECORD loses the removed files' lines, so
pip installs the rest as it would the whole.
"""

from __future__ import annotations

import argparse
import re
import sys
import zipfile
from pathlib import Path

MODELS = "transformers/models/"
# the model families the harness and its tests build or load (harness/models, tests' tiny models, GGUF files)
KEEP = frozenset(
    {"auto", "llama", "gpt2", "gpt_oss", "bloom", "gemma", "gemma2", "gemma3", "gemma3n", "gemma4", "qwen2", "qwen3",
     "mistral", "mixtral", "phi3", "smollm3"}
)  # fmt: skip
# a family named: `models.NAME` anywhere, or `from ..NAME` inside a family
NAMED = re.compile(r"(?:\bmodels\.|from \.\.)(?!models\.)([a-z0-9_]+)")


def family(name: str) -> str | None:
    """The model package a wheel member belongs to (`transformers/models/NAME/...`), or None."""
    if not name.startswith(MODELS):
        return None
    rest = name[len(MODELS) :]
    return rest.split("/", 1)[0] if "/" in rest else None


def kept_families(wheel: zipfile.ZipFile) -> set[str]:
    """KEEP, the families named outside transformers/models/, and what those import, to closure."""
    present: dict[str, list[str]] = {}
    core: set[str] = set()
    for name in wheel.namelist():
        if not name.endswith(".py"):
            continue
        named = set(NAMED.findall(wheel.read(name).decode("utf-8", "replace")))
        fam = family(name)
        if fam is None:
            core |= named if name.startswith("transformers/") else set()
        else:
            present.setdefault(fam, []).extend(named)
    keep, todo = set(), [f for f in KEEP | core if f in present]
    while todo:
        fam = todo.pop()
        if fam not in keep:
            keep.add(fam)
            todo.extend(f for f in present[fam] if f in present and f not in keep)
    return keep


def trim(path: Path) -> tuple[int, int]:
    """Rewrite the wheel at `path` without the families kept_families leaves out -> (bytes before, after)."""
    before = path.stat().st_size
    with zipfile.ZipFile(path) as src:
        keep = kept_families(src)
        members = [i for i in src.infolist() if family(i.filename) in keep | {None}]
        data = {i.filename: src.read(i.filename) for i in members}
    for name in data:
        if name.endswith(".dist-info/RECORD"):
            lines = data[name].decode().splitlines(keepends=True)
            data[name] = "".join(line for line in lines if line.split(",", 1)[0] in data).encode()
    tmp = path.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst:
        for info in members:
            dst.writestr(info, data[info.filename])
    tmp.replace(path)
    return before, path.stat().st_size


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("wheel", type=Path, help="a transformers-*.whl, rewritten in place")
    args = p.parse_args(argv)
    if not args.wheel.is_file() or not args.wheel.name.startswith("transformers-"):
        p.error(f"wheel: {args.wheel} is not a transformers wheel file")
    before, after = trim(args.wheel)
    print(f"{args.wheel}: {before / 1e6:.1f} MB -> {after / 1e6:.1f} MB", file=sys.stderr)


if __name__ == "__main__":
    main()
