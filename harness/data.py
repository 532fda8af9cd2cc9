"""Calibration and evaluation text, split so that the two never share a document, and token windows cut from it.

A source of text (`eval.data.path` for the evaluation windows, `eval.calibration.data.path` for the calibration
windows, null: the evaluation's) is a corpus that ships with every CPython, by name, or a path:
- `pydoc_topics` (the default, eval.data.path null): the English reference prose of `pydoc_data.topics`, one
  document per topic (the language reference's topics);
- `stdlib_docstrings`: the docstrings of the standard library's own modules (every module, class and function
  docstring of each .py file, read with `ast`, never imported), one document per module; tests, IDLE, lib2to3,
  tkinter, turtledemo, ensurepip, distutils and site-packages are left out (some distributions ship them apart).
  Its text depends on the Python version (`source_name` says which); it is read once and kept in the disk cache;
- a text file (one document per blank-line-separated block) or a folder (one document per *.txt / *.md file).
A document goes to calibration when a stable hash of its name falls in the calibration share, so the split does
not depend on order, seed or tokenizer. Calibration windows are cut from the calibration split of their source,
evaluation windows from the evaluation split of theirs, so the two never overlap, whichever sources they are.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from pydoc_data.topics import topics

import torch

from harness.io import cache_root, write_json_atomic

CALIBRATION_SHARE = 0.25
DEFAULT_CORPUS = "pydoc_topics"
# Folders of the standard library that some distributions ship apart, or that hold no library modules.
STDLIB_LEFT_OUT = frozenset(
    {"site-packages", "test", "tests", "idlelib", "lib2to3", "tkinter", "turtledemo", "ensurepip", "distutils",
     "pydoc_data", "__pycache__"}
)  # fmt: skip


def _module_docstrings(source: str) -> str:
    """Every module, class and function docstring of Python source, in the order ast.walk meets them (breadth first), joined by
    blank lines ('' when it has none)."""
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    found = (ast.get_docstring(node) for node in ast.walk(ast.parse(source)) if isinstance(node, kinds))
    return "\n\n".join(text for text in found if text)


@functools.cache
def stdlib_docstrings() -> dict[str, str]:
    """Module path (relative to the standard library) -> its docstrings, for every .py module of this Python's
    standard library outside STDLIB_LEFT_OUT that has any; parsed once (about 20 s) and kept in the disk cache
    per Python version."""
    path = cache_root() / "corpora" / f"stdlib_docstrings-{platform.python_version()}.json"
    if path.exists():
        return json.loads(path.read_text())
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = {}
    for file in sorted(root.rglob("*.py")):
        relative = file.relative_to(root)
        if STDLIB_LEFT_OUT & set(relative.parts[:-1]) or relative.parts[0].startswith("config-"):
            continue
        text = _module_docstrings(file.read_text(errors="replace"))
        if text:
            docs[relative.as_posix()] = text
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, docs)
    return docs


CORPORA = {DEFAULT_CORPUS: lambda: dict(topics), "stdlib_docstrings": stdlib_docstrings}


def source_name(path: str | None) -> str:
    """What a row records of a text source: the corpus name (stdlib_docstrings with its Python version), or the
    path as given; None is the default corpus."""
    path = DEFAULT_CORPUS if path is None else path
    if path == "stdlib_docstrings":
        return f"{path} (Python {platform.python_version()})"
    return path


def documents(path: str | None = None, key: str = "eval.data.path") -> dict[str, str]:
    """Name -> text of every document of the source `path` (a corpus name or a path; None: the default); `key`:
    the config key that named it, for errors."""
    path = DEFAULT_CORPUS if path is None else path
    if path in CORPORA:
        return dict(CORPORA[path]())
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.suffix in (".txt", ".md") and f.is_file())
        if not files:
            raise ValueError(f"{key}: {path} holds no .txt or .md file")
        return {str(f.relative_to(p)): f.read_text(errors="replace") for f in files}
    if p.is_file():
        blocks = [b.strip() for b in p.read_text(errors="replace").split("\n\n") if b.strip()]
        return {f"{p.name}#{i}": b for i, b in enumerate(blocks)}
    raise ValueError(
        f"{key}: {path} is neither a file nor a folder; allowed: a path, or a corpus ({', '.join(CORPORA)})"
    )


def is_calibration(name: str) -> bool:
    digest = hashlib.sha256(name.encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < CALIBRATION_SHARE


@dataclass(frozen=True)
class Split:
    calibration: str
    evaluation: str
    calibration_docs: tuple[str, ...]
    evaluation_docs: tuple[str, ...]


def split(path: str | None = None, key: str = "eval.data.path") -> Split:
    """Disjoint calibration and evaluation text (documents joined by blank lines, in name order) of the source
    `path` (documents' `path` and `key`)."""
    docs = documents(path, key)
    cal = sorted(n for n in docs if is_calibration(n))
    ev = sorted(n for n in docs if not is_calibration(n))
    if not cal or not ev:
        raise ValueError(f"{key}: {path} has too few documents to split into calibration and evaluation")
    join = lambda names: "\n\n".join(docs[n] for n in names)  # noqa: E731
    return Split(join(cal), join(ev), tuple(cal), tuple(ev))


BOS_RULES = ("auto", "always", "never")


def uses_bos(tokenizer, rule: str = "auto") -> bool:
    """Whether every window starts with the tokenizer's BOS token under `eval.bos=rule`.

    auto: what the tokenizer itself does when it encodes text (as llama.cpp's perplexity does); always: BOS
    even where the tokenizer would not add it; never: no BOS.
    """
    if rule not in BOS_RULES:
        raise ValueError(f"eval.bos: {rule!r} is not allowed; allowed: {', '.join(BOS_RULES)}")
    bos = tokenizer.bos_token_id
    if rule == "never":
        return False
    if rule == "always":
        if bos is None:
            raise ValueError(
                "eval.bos: always, but the tokenizer has no BOS token; allowed here: auto, never"
            )
        return True
    first = tokenizer("x", add_special_tokens=True)["input_ids"][:1]
    return bos is not None and first == [bos]


def text_ids(tokenizer, text: str) -> torch.Tensor:
    """The token ids of `text` without special tokens: (n,) int64."""
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def token_windows(
    tokenizer, text: str, count: int, length: int, seed: int = 0, bos: bool = False
) -> torch.Tensor:
    """`count` non-overlapping windows of `length` tokens from `text`, chosen with `seed`: (count, length) int64.

    With `bos`, each window is the tokenizer's BOS token followed by `length - 1` text tokens.
    """
    ids = text_ids(tokenizer, text)
    body = length - 1 if bos else length
    n_slots = ids.numel() // body
    if n_slots < count:
        raise ValueError(
            f"eval: the text holds {n_slots} windows of {length} tokens, fewer than the {count} asked for; "
            "lower eval.num_prompts / eval.prompt_tokens or give more text with eval.data.path"
        )
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(n_slots, generator=g)[:count].sort().values
    windows = torch.stack([ids[s * body : (s + 1) * body] for s in slots.tolist()])  # (count, body)
    if bos:
        first = torch.full((count, 1), tokenizer.bos_token_id, dtype=torch.long)
        windows = torch.cat([first, windows], dim=1)  # (count, length)
    return windows


CALIBRATION_KEY = "eval.calibration.data.path"


def calibration_source(point) -> tuple[str | None, str]:
    """The source a point's calibration windows are cut from and the config key that names it:
    eval.calibration.data.path, else eval.data.path."""
    if point.calibration_data_path is None:
        return point.data_path, "eval.data.path"
    return point.calibration_data_path, CALIBRATION_KEY


@dataclass(frozen=True)
class PointWindows:
    """A grid point's token windows, each (count, length) int64: calibration (seed; from the calibration split of
    calibration_source), generation prompts (seed) and teacher-forced sequences (seed + 1; both from the evaluation
    split of eval.data.path), all starting with BOS when `bos` (eval.bos resolved for the tokenizer)."""

    bos: bool
    calibration: torch.Tensor
    prompts: torch.Tensor
    sequences: torch.Tensor


def point_windows(tokenizer, point) -> PointWindows:
    """The windows of a harness.config.Point (its sources, sizes, seed and BOS rule)."""
    text = split(point.data_path)
    calibration_text = split(*calibration_source(point)).calibration
    bos = uses_bos(tokenizer, point.bos)
    return PointWindows(
        bos=bos,
        calibration=token_windows(
            tokenizer,
            calibration_text,
            point.calibration_sequences,
            point.calibration_tokens,
            point.seed,
            bos=bos,
        ),
        prompts=token_windows(
            tokenizer, text.evaluation, point.num_prompts, point.prompt_tokens, point.seed, bos=bos
        ),
        sequences=token_windows(
            tokenizer, text.evaluation, point.num_sequences, point.sequence_tokens, point.seed + 1, bos=bos
        ),
    )
