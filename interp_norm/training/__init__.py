"""Training and persistence: training runs, their configs, checkpoints on disk, files, devices, DDP.

Imports only :mod:`interp_norm.core` below it.
"""
