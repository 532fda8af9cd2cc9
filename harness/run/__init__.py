"""The pipeline every protocol shares: a run's records and resume (records.py), what the points of one model share
(context.py; baselines too big for memory are kept on disk between starts: kept_baseline.py), one grid point
measured (measure.py) and the grid's point runner (runner.py).
"""
