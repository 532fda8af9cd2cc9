"""`python -m harness.report RUN_DIR`: regenerate a sweep run directory's report (harness/report/sweep.py)."""

from harness.report.sweep import main

if __name__ == "__main__":
    main()
