"""Statistics over seeds: intervals and tests (``inference``), the per-checkpoint seed tables
(``seed_summary``), the arm-vs-arm comparisons (``seed_compare``) and the paper's claims with their
verdicts (``verdicts``).

Pure functions (numbers or DataFrames in, DataFrames out); an analysis like the others. Scoring a
model on its task lives in :mod:`interp_norm.core.scoring`, below training, which evaluates as it trains.
"""
