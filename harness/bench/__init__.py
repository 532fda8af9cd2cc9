"""The measurement commands, each `python -m harness.bench.<name>`, apart from the package's core: decode-step
speed and memory (perf, perf_ab), a grid point's stages against the plain forward (overhead), the capacity
demonstration (capacity_demo), the prefill attention's peak memory (attention_memory), and the /proc readers and
malloc setting these share (procmem)."""
