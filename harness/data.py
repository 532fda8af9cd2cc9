"""Calibration and evaluation text, split so that the two never share a document, and token windows cut from it.

Default text: the English reference prose that ships with every CPython (`pydoc_data.topics`), one document per
topic. `eval.data.path` replaces it with a text file (one document per blank-line-separated block) or a folder
(one document per *.txt / *.md file). A document goes to calibration when a stable hash of its name falls in the
calibration share, so the split does not depend on order, seed or tokenizer.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from pydoc_data.topics import topics

import torch

CALIBRATION_SHARE = 0.25


def documents(path: str | None = None) -> dict[str, str]:
    """Name -> text of every document of the corpus."""
    if path is None:
        return dict(topics)
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.suffix in (".txt", ".md") and f.is_file())
        if not files:
            raise ValueError(f"eval.data.path: {path} holds no .txt or .md file")
        return {str(f.relative_to(p)): f.read_text(errors="replace") for f in files}
    if p.is_file():
        blocks = [b.strip() for b in p.read_text(errors="replace").split("\n\n") if b.strip()]
        return {f"{p.name}#{i}": b for i, b in enumerate(blocks)}
    raise ValueError(f"eval.data.path: {path} is neither a file nor a folder")


def is_calibration(name: str) -> bool:
    digest = hashlib.sha256(name.encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < CALIBRATION_SHARE


@dataclass(frozen=True)
class Split:
    calibration: str
    evaluation: str
    calibration_docs: tuple[str, ...]
    evaluation_docs: tuple[str, ...]


def split(path: str | None = None) -> Split:
    """Disjoint calibration and evaluation text (documents joined by blank lines, in name order)."""
    docs = documents(path)
    cal = sorted(n for n in docs if is_calibration(n))
    ev = sorted(n for n in docs if not is_calibration(n))
    if not cal or not ev:
        raise ValueError(
            f"eval.data.path: {path} has too few documents to split into calibration and evaluation"
        )
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


@dataclass(frozen=True)
class PointWindows:
    """A grid point's token windows, each (count, length) int64: calibration (seed), generation prompts (seed) and
    teacher-forced sequences (seed + 1), all starting with BOS when `bos` (eval.bos resolved for the tokenizer)."""

    bos: bool
    calibration: torch.Tensor
    prompts: torch.Tensor
    sequences: torch.Tensor


def point_windows(tokenizer, point) -> PointWindows:
    """The windows of a harness.config.Point (its data_path, sizes, seed and BOS rule)."""
    text = split(point.data_path)
    bos = uses_bos(tokenizer, point.bos)
    return PointWindows(
        bos=bos,
        calibration=token_windows(
            tokenizer,
            text.calibration,
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
