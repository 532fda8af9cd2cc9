"""Codes of different widths in one row of bits: each head's codes (D,) packed at its own per-element widths
(a `Layout`, 0 to 8 bits each), LSB first, element 0's bits first.

Bit k of a row is bit k - start[c] of code c, start[c] the sum of the widths before c; byte j holds bits
8 j .. 8 j + 7, bit 8 j + i at value 2**i. With every width equal to b in (2, 3, 4, 8) a row is exactly
kernels.reference.pack's (code j at bits [b j, b j + b)), and `pack`/`unpack` take that path (`Layout.width`).
Where every head has the same widths and they fall in runs of one width that each start on a byte and fill whole
bytes (a grouped plan: 16 components at 0 to 8 bits a group), a row is those runs' rows side by side (`Layout.runs`),
and pack/unpack go run by run: a run of 2, 3, 4 or 8 bits is a reference row, one of 1 bit eight codes a byte, one of
5, 6 or 7 bits eight codes in each little-endian word of that many bytes (the same bits, a word at a time; read back
in uint8, each code from the one or two bytes its bits lie in). Other rows of mixed widths are written and read an
element at a time through the two bytes that hold its bits (pack_bits, unpack_bits). The CPU packed path writes
every new token and reads every stored block at every decode step through these. A width of 0 stores nothing (its
code is 0). Every head of a layout holds the same number of bits, a whole number of bytes (the rows of one store
line up).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kernels import reference

MAX_WIDTH = 8
REFERENCE_WIDTHS = (2, 3, 4, 8)  # one width for every element: kernels.reference's rows
WORD_WIDTHS = (5, 6, 7)  # widths whose runs go eight codes at a time through a word of that many bytes
# the widths of Layout.runs; 1 bit goes 8 codes a byte in uint8 (a 1-byte word, without _pack_words' int64)
RUN_WIDTHS = (0, 1, *REFERENCE_WIDTHS, *WORD_WIDTHS)


@dataclass(frozen=True, eq=False)
class Layout:
    """The widths (H, D) of H heads' codes and where each code's bits lie: every row holds `bits` bits."""

    widths: torch.Tensor  # (H, D) int64 in [0, MAX_WIDTH]
    # an element's bits lie in two neighbouring bytes (a width is at most 8): the first (H, D) int64 (clamped to the
    # row, as is the second), and the element's first bit within it (H, D) int32
    byte: torch.Tensor
    shift: torch.Tensor
    # where every head has the same widths in byte-aligned runs: (first element, end, first byte, end, width) per
    # run of one width, in order (`_runs`); else None
    runs: tuple[tuple[int, int, int, int, int], ...] | None = None

    @property
    def bits(self) -> int:
        return int(self.widths[0].sum()) if self.widths.numel() else 0

    @property
    def width(self) -> int | None:
        """The one width of every element of every head where it is one of REFERENCE_WIDTHS, else None."""
        if not self.widths.numel():
            return None
        w = int(self.widths.flatten()[0])
        return w if w in REFERENCE_WIDTHS and bool((self.widths == w).all()) else None

    @property
    def nbytes(self) -> int:
        """Bytes of one packed row."""
        return self.bits // 8


def layout(widths: torch.Tensor) -> Layout:
    """The Layout of per-element widths (H, D) (any integer dtype); ValueError unless every width lies in
    [0, MAX_WIDTH] and every head's widths sum to one multiple of 8."""
    widths = widths.long()
    if widths.dim() != 2:
        raise ValueError(f"bitstream widths: expected (heads, elements); got shape {tuple(widths.shape)}")
    if widths.numel() and (int(widths.min()) < 0 or int(widths.max()) > MAX_WIDTH):
        raise ValueError(f"bitstream widths: each in [0, {MAX_WIDTH}]")
    totals = widths.sum(1)
    if len(totals) and (bool((totals != totals[0]).any()) or int(totals[0]) % 8):
        raise ValueError(
            f"bitstream widths: every head must hold one whole number of bytes; got {totals.tolist()}"
        )
    start = torch.cumsum(widths, 1) - widths  # (H, D): the first bit of each element
    last = max(int(totals[0]) // 8 - 1, 0) if len(totals) else 0
    return Layout(widths, (start // 8).clamp(max=last), (start % 8).int(), _runs(widths))


def _runs(widths: torch.Tensor) -> tuple[tuple[int, int, int, int, int], ...] | None:
    """Layout.runs of widths (H, D) int64: None unless every head's widths are the first's and each run of one width
    starts on a byte and fills whole bytes (3, 5, 6 or 7 bits in runs of eight elements; 0 bits any run)."""
    if not widths.numel() or bool((widths != widths[:1]).any()):
        return None
    row = widths[0].tolist()
    runs, first, bit = [], 0, 0
    for c in range(1, len(row) + 1):
        if c < len(row) and row[c] == row[first]:
            continue
        w, n = row[first], c - first
        if w not in RUN_WIDTHS or bit % 8 or (n * w) % 8 or (w in (3, *WORD_WIDTHS) and n % 8):
            return None
        runs.append((first, c, bit // 8, (bit + n * w) // 8, w))
        first, bit = c, bit + n * w
    return tuple(runs)


def pack(codes: torch.Tensor, lay: Layout) -> torch.Tensor:
    """codes (B, H, T, D) (integers in [0, 2**width)) -> uint8 (B, H, T, lay.nbytes)."""
    if lay.width is not None:
        return reference.pack(codes, lay.width)
    if lay.runs is not None:
        return pack_runs(codes, lay)
    return pack_bits(codes, lay)


def pack_runs(codes: torch.Tensor, lay: Layout) -> torch.Tensor:
    """pack run by run (Layout.runs): each run's codes packed as a reference row of its width, side by side."""
    rows = []
    for first, end, _, _, w in lay.runs:
        part = codes[..., first:end]
        if w == 1:
            bits = part.to(torch.uint8).view(
                *part.shape[:-1], -1, 8
            )  # (..., n / 8, 8): byte j's bit i: code 8 j + i
            rows.append(sum(bits[..., i] << i for i in range(8)).to(torch.uint8))
        elif w in WORD_WIDTHS:
            rows.append(_pack_words(part, w))
        elif w:
            rows.append(reference.pack(part, w))
    if not rows:
        return torch.zeros(*codes.shape[:-1], 0, dtype=torch.uint8, device=codes.device)
    return torch.cat(rows, -1)


def pack_bits(codes: torch.Tensor, lay: Layout) -> torch.Tensor:
    """pack through the layout's bytes (any widths): each element's bits added into the two bytes that hold them
    (no two elements share a bit)."""
    B, H, T, _ = codes.shape
    rows = torch.zeros(B, H, T, lay.nbytes, dtype=torch.int32, device=codes.device)
    if not lay.bits:
        return rows.to(torch.uint8)
    mask = (1 << lay.widths.int()) - 1  # (H, D)
    placed = (codes.int() & mask[None, :, None]) << lay.shift[None, :, None]  # (B, H, T, D), under 2**16
    first = lay.byte[None, :, None].expand(B, H, T, -1)
    rows.scatter_add_(-1, first, placed & 0xFF)
    rows.scatter_add_(-1, (first + 1).clamp(max=lay.nbytes - 1), placed >> 8)  # 0 where clamped: no bit there
    return rows.to(torch.uint8)


def unpack(packed: torch.Tensor, lay: Layout, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """uint8 (B, H, T, lay.nbytes) -> codes (B, H, T, D) in dtype (int64, or a float type that holds them all
    exactly) (0 where a width is 0)."""
    if lay.width is not None:
        return reference.unpack(packed, lay.width, lay.widths.shape[1]).to(dtype)
    if lay.runs is not None:
        return unpack_runs(packed, lay, dtype)
    return unpack_bits(packed, lay).to(dtype)


def unpack_runs(packed: torch.Tensor, lay: Layout, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """unpack run by run (Layout.runs): each run's bytes read as a reference row of its width, or a word at a time."""
    codes = torch.empty(*packed.shape[:-1], lay.widths.shape[1], dtype=dtype, device=packed.device)
    for first, end, byte, byte_end, w in lay.runs:
        part = packed[..., byte:byte_end]
        if w == 0:
            codes[..., first:end] = 0
        elif w == 1:
            codes[..., first:end] = torch.stack([(part >> i) & 1 for i in range(8)], -1).flatten(-2)
        elif w in WORD_WIDTHS:
            codes[..., first:end] = _unpack_words(part, w)
        else:
            codes[..., first:end] = reference.unpack(part, w, end - first)
    return codes


def _pack_words(codes: torch.Tensor, w: int) -> torch.Tensor:
    """codes (..., n) of w bits, n a multiple of 8 -> uint8 (..., n w / 8): code 8 j + i at bits [w i, w i + w) of
    word j, a little-endian integer of bytes [w j, w j + w). The word is the sum of its codes moved into place (no
    two share a bit), its bytes one broadcast shift of it."""
    lead, n = codes.shape[:-1], codes.shape[-1]
    code_bits, byte_bits = _word_shifts(w, codes.device)
    word = (codes.to(torch.int64).view(*lead, n // 8, 8) << code_bits).sum(-1)  # (..., n / 8)
    return ((word[..., None] >> byte_bits) & 0xFF).to(torch.uint8).view(*lead, n * w // 8)


@functools.cache
def _word_shifts(w: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The first bit of each of a w-bit word's 8 codes (8,) and of each of its w bytes (w,), int64."""
    return torch.arange(0, 8 * w, w, device=device), torch.arange(0, 8 * w, 8, device=device)


@functools.cache
def _word_plan(w: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where code i (0-7) of a w-bit word lies (_pack_words): its first byte (8,) int64 and the bit it starts at in
    it (8,) uint8; the byte holding its last bit (8,) int64 and, where that is the next byte, the factor 2**(8 -
    start bit) (8,) uint8 that moves that byte's low bits above the first byte's (else 0)."""
    first_bit = torch.arange(8) * w
    first, start = first_bit // 8, first_bit % 8
    crosses = start + w > 8
    last = torch.where(crosses, first + 1, first)
    carry = torch.where(crosses, 2 ** (8 - start), 0)
    return (
        first.to(device),
        start.to(torch.uint8).to(device),
        last.to(device),
        carry.to(torch.uint8).to(device),
    )


def _unpack_words(part: torch.Tensor, w: int) -> torch.Tensor:
    """Inverse of _pack_words: uint8 (..., n w / 8) -> uint8 codes (..., n), in uint8 arithmetic: each code from
    the byte its first bit lies in, shifted down, and the next byte's low bits multiplied into place where it runs
    past (uint8 products keep their low 8 bits: what overflows lies above the code's w bits, which the mask drops)."""
    first, start, last, carry = _word_plan(w, part.device)
    words = part.unflatten(-1, (-1, w))  # (..., n / 8, w): word j's bytes
    codes = words.index_select(-1, first) >> start  # (..., n / 8, 8): code 8 j + i at [..., j, i]
    codes |= words.index_select(-1, last) * carry
    codes &= (1 << w) - 1
    return codes.flatten(-2)


def unpack_bits(packed: torch.Tensor, lay: Layout) -> torch.Tensor:
    """unpack through the layout's bytes (any widths): each element from the two bytes that hold its bits."""
    B, H, T, _ = packed.shape
    if not lay.bits:
        return torch.zeros(B, H, T, lay.widths.shape[1], dtype=torch.long, device=packed.device)
    rows = packed.to(torch.int32)
    first = lay.byte[None, :, None].expand(B, H, T, -1)  # (B, H, T, D)
    pair = rows.gather(-1, first) | rows.gather(-1, (first + 1).clamp(max=rows.shape[-1] - 1)) << 8
    mask = (1 << lay.widths.int()) - 1  # (H, D)
    return ((pair >> lay.shift[None, :, None]) & mask[None, :, None]).long()
