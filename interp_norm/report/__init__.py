"""Reports: the analysis registry, ``reproduce``, the per-checkpoint worker, the model card, figures and dashboard."""
