"""Core: the addition task, the model and its components, the hook and node vocabularies, scoring.

The lowest layer: it imports only :mod:`interp_norm.errors`, transformer-lens and torch.
"""
