"""The pipeline every protocol shares (DESIGN.md section 2, `run/`).

- records.py: a run directory's points/, one JSON per finished point, and resume (a point whose file exists is
  done), for the grid and passkey;
- context.py: what every point of one model shares: the model loaded once, its windows, calibration (cached on
  disk), the unquantized baseline and the shared full-precision prefill;
- measure.py: one grid point on a context: its allocation, its quantized (and evicting) cache, its metrics;
- runner.py: the grid's point runner: contexts built in order, the baseline row, every pending point measured
  and recorded, results.parquet kept readable.
The start record (config.yaml and env.json before any model loads) is harness.io.start_record.
"""
