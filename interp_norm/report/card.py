"""The model card: one row per checkpoint with its architecture, training and accuracy per split.

A table builder, not a figure: it reads what a checkpoint already records (configs, step,
training curve, stored or fresh evaluation) and sets the paper's numbers beside ours.
:func:`interp_norm.report.plots.plot_model_card` and ``plot_accuracy_by_split`` draw it; ``reproduce``
writes it as ``model_card.csv``.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import pandas as pd

__all__ = ["PAPER_PER_TOKEN_ACCURACY", "SPLITS", "model_card"]

# Menary et al. (2024), results table: per-token accuracy of the Baseline models on the paper's
# task and model size (arXiv 2406.17837). Our CPU models are smaller and train on a smaller task, so
# these are a reference point for the shape (ID ≈ equal, QKV-Norm worse OOD), not a target.
PAPER_PER_TOKEN_ACCURACY: dict[str, dict[str, float]] = {
    "pre": {"id": 0.9138, "interp": 0.8746, "extrap": 0.6665},
    "qkv": {"id": 0.9099, "interp": 0.8254, "extrap": 0.4676},
}
SPLITS = ("id", "interp", "extrap")


def model_card(
    models: Mapping[str, Any],
    evaluation: Optional[pd.DataFrame] = None,
    paper: Mapping[str, Mapping[str, float]] = PAPER_PER_TOKEN_ACCURACY,
) -> pd.DataFrame:
    """One row per checkpoint: architecture, training, per-split accuracy and the paper's number.

    ``models`` maps a name to a :class:`~interp_norm.training.checkpoints.CheckpointInfo` (or a
    ``(model, info)`` pair). ``evaluation``: :func:`interp_norm.core.scoring.evaluate` rows with a
    ``checkpoint`` column; without it, the accuracies stored in the checkpoint are used.
    """
    rows = []
    for name, item in models.items():
        info = item[1] if isinstance(item, tuple) else item
        cfg, tc = info.model_cfg, info.train_cfg
        row: dict[str, Any] = dict(
            checkpoint=name, attn_norm=cfg.attn_norm, norm_kind=cfg.norm_kind,
            calibration=getattr(cfg, "calibration", "none"), seed=cfg.seed,
            n_layers=cfg.n_layers, n_heads=cfg.n_heads, d_model=cfg.d_model, d_head=cfg.d_head, d_mlp=cfg.d_mlp,
            n_params=_n_params(item[0]) if isinstance(item, tuple) else math.nan,
            task_terms="/".join(
                ",".join(map(str, t)) for t in (info.task.train_terms, info.task.interp_terms, info.task.extrap_terms)
            ),
            steps=info.step,
            examples=(info.step or 0) * tc.batch_size if tc is not None else math.nan,
            lr=tc.lr if tc is not None else math.nan,
        )
        if len(info.curve) and "loss" in info.curve:
            row["final_train_loss"] = float(info.curve["loss"].iloc[-1])
        if evaluation is not None and len(evaluation):
            ev = evaluation[evaluation["checkpoint"] == name] if "checkpoint" in evaluation else evaluation
            accs = {r["split"]: r for r in ev.to_dict("records")}
        else:
            accs = {r["split"]: r for r in info.metrics.get("evaluation", []) if "split" in r}
        for s in SPLITS:
            r = accs.get(s, {})
            row[f"{s}_acc"] = r.get("per_token_acc", math.nan)
            row[f"paper_{s}_acc"] = paper.get(cfg.attn_norm, {}).get(s, math.nan)
            row[f"{s}_exact"] = r.get("exact_match", math.nan)
        rows.append(row)
    return pd.DataFrame(rows)


def _n_params(model: Any) -> int:
    return int(sum(p.numel() for p in model.parameters()))
