"""What a store needs to turn keys back before RoPE and forward again (nuqkey's and pca's key stores): `turn`, the
rotary embedding's rotation of each pair (i, i + R / 2) by an angle, and `TokenPositions`, the sequence position
of every token a store holds.

Positions: the token after the sink tokens starts at position `first` (or where `starts_at` says, for a sliding
window that has already dropped the first tokens); held tokens are contiguous positions ending at the last one
appended, and only after an eviction that keeps scattered tokens (`select`) are they kept, int32 (B, T), counted in
the store's bytes (POSITION_BYTES each). A batch row's positions are the cache's token count, as every other cache
here assumes (a left-padded row is quantized in a frame turned by its padding: still exact to turn back).
"""

from __future__ import annotations

import torch

POSITION_BYTES = 4  # int32 positions, held only after a scattered eviction


def turn(x: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, D) float32 with each rotary pair (i, i + R / 2) turned by angle (B or 1, 1, T, R / 2) radians;
    channels past R unchanged."""
    half = angle.shape[-1]
    if not half:
        return x
    a, b = x[..., :half], x[..., half : 2 * half]
    cos, sin = torch.cos(angle), torch.sin(angle)
    out = torch.empty_like(x)  # each half written in place (no concatenation)
    torch.mul(a, cos, out=out[..., :half]).sub_(b * sin)
    torch.mul(b, cos, out=out[..., half : 2 * half]).add_(a * sin)
    out[..., 2 * half :] = x[..., 2 * half :]
    return out


class TokenPositions:
    """The sequence positions of the tokens one store holds (module docstring), and the rotary angles there."""

    def __init__(self, theta: torch.Tensor, batch: int, device, first: int = 0):
        self.theta = theta.to(device)  # (R / 2,) float32 radians per position of each rotary pair
        self.batch, self.device = batch, device
        self.next = first  # the sequence position of the next token appended
        self.kept: torch.Tensor | None = None  # int32 (B, T) after a scattered eviction; else contiguous

    def starts_at(self, position: int, length: int) -> None:
        """The next token appended sits at sequence position `position` (the store, holding `length` tokens, must
        be empty)."""
        assert length == 0, "starts_at: the store already holds tokens"
        self.next = position

    def angle(self, positions: torch.Tensor) -> torch.Tensor:
        """positions (B or 1, T) -> the angles (B or 1, 1, T, R / 2) each rotary pair turns by there."""
        return (positions.double()[..., None] * self.theta.double()).float()[:, None]

    def new(self, count: int) -> torch.Tensor:
        """The positions (1, count) of the next `count` tokens, recorded as appended."""
        new = torch.arange(self.next, self.next + count, device=self.device)[None]
        if self.kept is not None:
            self.kept = torch.cat([self.kept, new.int().expand(self.batch, count)], 1)
        self.next += count
        return new

    def held(self, start: int, end: int, length: int) -> torch.Tensor:
        """The positions (B or 1, end - start) int64 of held tokens [start, end) of `length` held."""
        if self.kept is not None:
            return self.kept[:, start:end].long()
        first = self.next - length
        return torch.arange(first + start, first + end, device=self.device)[None]

    def keep_last(self, n: int, length: int) -> None:
        if self.kept is not None:
            self.kept = self.kept[:, max(length - n, 0) :].clone()

    def select(self, index: torch.Tensor, length: int) -> None:
        """Keep the positions at index (B, n) of the `length` held (per batch row)."""
        self.kept = torch.gather(self.held(0, length, length).expand(self.batch, -1), 1, index).int()

    def take_rows(self, index: torch.Tensor) -> None:
        """Keep the batch rows at index (n,)."""
        if self.kept is not None:
            self.kept = self.kept.index_select(0, index)
        self.batch = index.shape[0]

    def keep_first(self, n: int, length: int) -> None:
        """Drop the positions of the last `length - n` of the `length` held, the last appended: the next token
        appended takes the first of theirs."""
        self.next -= length - n
        if self.kept is not None:
            self.kept = self.kept[:, :n]

    def nbytes(self) -> int:
        return 0 if self.kept is None else self.kept.numel() * POSITION_BYTES
