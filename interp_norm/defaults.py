"""Named choices and defaults that the analyses and the command line share, with no imports.

One source for each: the noise and collapse modules, the circuits package and ``interp-norm``'s
``--help`` all read them from here, and this module imports nothing, so showing a subcommand's
defaults never loads torch.
"""

#: Noise levels (RMS of κ) of the paper's accuracy-vs-noise sweep.
DEFAULT_NOISE_LEVELS: tuple[float, ...] = (0.0, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3)
#: Noise levels of the collapse sweep (dense where 1% collapse is reached; uniform κ needs < 1/√3).
DEFAULT_COLLAPSE_LEVELS: tuple[float, ...] = (0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.13, 0.17, 0.2, 0.3, 0.4, 0.5)
#: Where the noise enters relative to a q/k/v norm.
PLACEMENTS: tuple[str, ...] = ("before_norm", "after_norm")
#: Distributions of κ.
DISTRIBUTIONS: tuple[str, ...] = ("uniform", "normal")
#: Per-example metrics of the circuits package, by name.
CIRCUIT_METRICS: tuple[str, ...] = ("logit_diff", "correct_prob", "kl_to_clean")
#: Methods scored against the ground-truth suite.
BENCHMARK_METHODS: tuple[str, ...] = ("exact", "eap", "eap-ig", "atp*", "pruning")

__all__ = ["DEFAULT_NOISE_LEVELS", "DEFAULT_COLLAPSE_LEVELS", "PLACEMENTS", "DISTRIBUTIONS", "CIRCUIT_METRICS",
           "BENCHMARK_METHODS"]
