"""`python -m harness.compare_runs RUN_A RUN_B [--out DIR]`: this module is the command's entry; the code lives in
harness/report/compare.py."""

from harness.report.compare import main

if __name__ == "__main__":
    main()
