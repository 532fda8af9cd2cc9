"""The reading side of a run: what its points are turned into for people to read. Callers import the submodules.

- labels: a point's category, configuration, cache and family, and the order points are listed in;
- tables: the sweep run's claim, grid, peer and infeasible tables, and markdown_table;
- paired: paired differences to uniform or to the plain cache with their bootstrap intervals;
- plots: the Pareto, entropy and allocation figures (matplotlib);
- sweep: a sweep run directory's page (results.parquet, tables.md, figures): `python -m harness.report RUN_DIR`;
- passkey, claim, compare: the passkey run's page, the claim protocol's tables, two runs compared point by point.
"""
