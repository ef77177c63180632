"""The paper's Checkpoint calibration (its fitting mode is explicit state, not module attributes).

After ``calibrate(tokens)`` each Calibration layer's output has the target std over the real
(non-padding) entries of that batch; this is checked from the layers' own inputs and outputs,
captured with torch forward hooks on a second, frozen forward pass, and the stds computed here.
"""

from __future__ import annotations

import pytest
import torch

from interp_norm.core import task as T
from interp_norm.core.components import Calibration, fitting_calibration
from interp_norm.core.model import HookedNormTransformer, ModelConfig


def _model(attn_norm: str) -> HookedNormTransformer:
    torch.manual_seed(0)
    return HookedNormTransformer(ModelConfig.preset("tiny", attn_norm=attn_norm, calibration="paper")).eval()


def _tokens() -> torch.Tensor:
    torch.manual_seed(1)
    tok = torch.randint(0, 12, (6, 10))
    tok[2:, 7:] = T.PAD_ID  # padding: must not count in the fitted std
    return tok


@pytest.mark.parametrize("attn_norm", ["pre", "qkv"])
def test_calibrate_fits_every_layer_to_its_target_std_on_real_tokens(attn_norm):
    model, tokens = _model(attn_norm), _tokens()
    valid = tokens != T.PAD_ID
    model.calibrate(tokens)
    seen = []
    handles = [m.register_forward_hook(lambda m, args, kwargs, out: seen.append((m, args, kwargs, out)), with_kwargs=True)
               for m in model.modules() if isinstance(m, Calibration)]
    try:
        with torch.no_grad():
            model(tokens)
    finally:
        for h in handles:
            h.remove()
    assert len(seen) >= 4
    for m, (x,), kw, out in seen:
        n = x.shape[-1]
        if m.kind == "scores":  # causal query/key pairs that are both real tokens
            keep = torch.ones(n, n, dtype=torch.bool).tril() & valid[:, None, :n, None] & valid[:, None, None, :n]
            got = out.masked_select(keep.expand_as(out)).std()
            assert float(got) == pytest.approx(m.std, rel=1e-4)
            continue
        mask = valid[:, : x.shape[1]]
        measured = kw.get("measure")
        measured = out if measured is None else measured * m.factor  # what the factor was fitted on, scaled
        target = m.std * (float(kw["relative_to"][mask].std()) if kw.get("relative_to") is not None else 1.0)
        assert float(measured[mask].std()) == pytest.approx(target, rel=1e-4)


def test_fitting_is_off_outside_calibrate_even_after_an_error():
    model, tokens = _model("pre"), _tokens()
    model.calibrate(tokens)
    before = model.calibration_factors()
    with torch.no_grad():
        model(torch.randint(0, 12, (3, 8)))  # another batch: factors stay frozen
    assert model.calibration_factors() == before
    with pytest.raises(RuntimeError):
        with fitting_calibration(tokens != T.PAD_ID):
            raise RuntimeError("boom")
    with torch.no_grad():
        model(torch.randint(0, 12, (3, 8)))
    assert model.calibration_factors() == before
    assert not any(hasattr(m, "valid") for m in model.modules() if isinstance(m, Calibration))
