"""What this process holds, as Linux reports it (/proc/self/status), and the glibc setting that the memory
measurements (harness.bench.capacity_demo, harness.bench.attention_memory) run their child processes under.

glibc's MALLOC_MMAP_THRESHOLD_: buffers at least this large are mapped on their own, so a freed one goes back to
the system at once instead of staying in the heap (measured in results/capacity/README.md).
"""

from __future__ import annotations

from pathlib import Path

MMAP_THRESHOLD = "MALLOC_MMAP_THRESHOLD_"  # glibc's tunable, an environment variable
MMAP_THRESHOLD_BYTES = 1 << 16  # what the measurements set it to: 64 KiB
STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")


def status_bytes(key: str) -> int:
    """A memory field of /proc/self/status in bytes: VmPeak (peak address space), VmRSS (resident), VmHWM (peak
    resident)."""
    for line in STATUS.read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"no {key} in {STATUS}")


def reset_peak_resident() -> None:
    """VmHWM := VmRSS, so that the next peak read is the peak from here on."""
    CLEAR_REFS.write_text("5")
