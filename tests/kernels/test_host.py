"""kernels/host.py: the launchers' integer helpers agree with exact arithmetic."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from kernels.host import cdiv, next_power_of_2


@given(st.integers(0, 10**9), st.integers(1, 10**6))
def test_cdiv_is_the_ceiling_of_the_quotient(a, b):
    q = cdiv(a, b)
    assert q * b >= a and (q - 1) * b < a if a else q == 0
    assert q == math.ceil(a / b)  # exact in floats at these sizes


@given(st.integers(0, 2**40))
def test_next_power_of_2_is_the_smallest_power_at_least_n(n):
    p = next_power_of_2(n)
    assert p & (p - 1) == 0 and p >= max(n, 1) and (p == 1 or p // 2 < n)
