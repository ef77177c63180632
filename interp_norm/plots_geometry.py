"""Old location of the geometry figures; they live in :mod:`interp_norm.plots.geometry` (kept so old imports work)."""

from interp_norm.plots.geometry import *  # noqa: F401,F403
from interp_norm.plots.geometry import __all__  # noqa: F401
