"""`python -m harness.sensitivity ...`: the sensitivity check's command (harness/protocols/sensitivity_check.py)."""

from harness.protocols.sensitivity_check import main

main()
