"""The protocols: each turns a validated config into its points, runs them through the shared pipeline
(harness.run, harness.io.start_record) and writes its page (harness.report).

- sweep.py: the grid, `python -m harness [+sweep=NAME]` (sweep.protocol: runner, the default);
- claim.py: the public write-up's own measurement (sweep.protocol: claim);
- passkey.py: passkey retrieval through a quantized cache, `python -m harness.passkey`;
- sensitivity_check.py: does the sensitivity proxy rank heads like the real KL, `python -m harness.sensitivity`.
`PROTOCOLS` maps a sweep's `protocol` to the module whose `run(cfg, points)` runs it (harness/__main__.py).
"""

from harness.protocols import claim, sweep

PROTOCOLS = {"runner": sweep, "claim": claim}
