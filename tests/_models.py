"""Model builders shared by several test files."""

from __future__ import annotations

import torch

from interp_norm import HookedNormTransformer, ModelConfig


def make_model(seed: int = 0, **kw) -> HookedNormTransformer:
    """A tiny model with every gain and bias moved away from its init, so gains are tested too."""
    model = HookedNormTransformer(ModelConfig.preset("tiny", seed=seed, **kw)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".w") or name.endswith(".b") or name.endswith("b_O"):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model
