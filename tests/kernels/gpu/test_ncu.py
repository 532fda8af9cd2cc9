"""kernels/gpu/ncu.py: reading Nsight Compute's raw CSV (the profiling itself needs a GPU)."""

from __future__ import annotations

import pytest

from kernels.gpu import ncu

RAW = """==PROF== Connected to process 123
"ID","Kernel Name","gpu__time_duration.sum","dram__bytes_read.sum","gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed","sm__inst_executed.sum.pct_of_peak_sustained_elapsed","sm__warps_active.avg.pct_of_peak_sustained_active","launch__registers_per_thread","smsp__inst_executed.sum","smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio","smsp__average_warps_issue_stalled_wait_per_issue_active.ratio","smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio","smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio"
"","","nsecond","byte","%","%","%","register/thread","inst","ratio","ratio","ratio","ratio"
"0","_decode_packed_kernel","250,000","344000000","78.5","33.9","40.1","112","43000000","2.5","0.75","0.10","1,200.5"
"""


def test_raw_page_to_one_summary_per_launch():
    (record,) = ncu.parse_raw(RAW)
    got = ncu.summarize(record, "4")
    assert got["duration_us"] == 250.0 and got["dram_bytes_read"] == 344e6 and got["registers"] == 112
    assert (
        got["dram_pct_of_peak"] == 78.5
        and got["issue_pct_of_peak"] == 33.9
        and got["achieved_occupancy_pct"] == 40.1
    )
    assert got["thread_instr_per_dram_byte"] == pytest.approx(32 * 43e6 / 344e6, abs=0.01)
    assert got["top_stalls"] == "math_pipe_throttle=1200.50 long_scoreboard=2.50 wait=0.75"


def test_no_records_when_ncu_printed_none():
    assert ncu.parse_raw("==ERROR== no kernels were profiled\n") == []
