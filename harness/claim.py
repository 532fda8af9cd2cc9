"""`python -m harness.claim RUN_DIR...`: rewrite claim runs' tables.md from their rows (harness/protocols/claim.py)."""

from harness.protocols.claim import main

if __name__ == "__main__":
    main()
