"""Old location of the noise figures; they live in :mod:`interp_norm.plots.noise` (kept so old imports work)."""

from interp_norm.plots.noise import *  # noqa: F401,F403
from interp_norm.plots.noise import __all__  # noqa: F401
