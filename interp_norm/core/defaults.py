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
#: Noise levels of the collapse sweep on a TransformerBridge (``bridge_collapse``, ``interp-norm collapse`` on a
#: Hugging Face model): coarser than ours, kept as they were when the two implementations merged.
BRIDGE_COLLAPSE_LEVELS: tuple[float, ...] = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3)
#: Numbers per block of scores in the bridge collapse sweep (4M: about 32 MB in float64; a few such blocks
#: live at once). Results do not depend on it.
COLLAPSE_MAX_ELEMENTS: int = 1 << 22
#: Text windows per forward pass of ``collapse`` / ``geometry`` on a Hugging Face model when none is given
#: (``window_batch`` None, no ``--window-batch``): the analyses hold one block's hooks of one layer at a time,
#: so more windows add only per-row results; the default 8 windows run in one pass, as before.
WINDOW_BATCH: int = 8
#: Attention normalisation placements of our models, in the order tables and figures show them.
ATTN_NORMS: tuple[str, ...] = ("pre", "qkv", "qk", "none")
#: How every table, figure and message names a variant.
VARIANT_LABELS: dict[str, str] = {"pre": "Pre-Norm", "qkv": "QKV-Norm", "qk": "QK-Norm", "none": "No-Norm"}
#: A row of attention is *sparse* when its largest weight is at least this (the paper's 95%).
SPARSE_THRESHOLD: float = 0.95
#: A row is *non-sparse* when its largest weight is below this (the paper's 70%).
NONSPARSE_THRESHOLD: float = 0.70
#: Which rows a noise experiment perturbs: every row, only sparse ones, or only non-sparse ones.
NOISED_ROWS: tuple[str, ...] = ("all", "sparse", "nonsparse")
#: Per-example metrics of the circuits package, by name.
CIRCUIT_METRICS: tuple[str, ...] = ("logit_diff", "correct_prob", "kl_to_clean")
#: Methods scored against the ground-truth suite.
BENCHMARK_METHODS: tuple[str, ...] = ("exact", "eap", "eap-ig", "atp*", "pruning")

__all__ = ["DEFAULT_NOISE_LEVELS", "DEFAULT_COLLAPSE_LEVELS", "BRIDGE_COLLAPSE_LEVELS", "COLLAPSE_MAX_ELEMENTS", "WINDOW_BATCH",
           "PLACEMENTS", "DISTRIBUTIONS", "ATTN_NORMS", "VARIANT_LABELS", "SPARSE_THRESHOLD", "NONSPARSE_THRESHOLD",
           "NOISED_ROWS", "CIRCUIT_METRICS", "BENCHMARK_METHODS"]
