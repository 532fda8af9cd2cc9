"""`python -m harness.passkey ...`: the passkey protocol's command (harness/protocols/passkey.py)."""

from harness.protocols.passkey import main

if __name__ == "__main__":
    main()
