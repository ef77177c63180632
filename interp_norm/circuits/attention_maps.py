"""Attention-circuit maps for addition: which heads attend sparsely to which operand digit.

Every token of ``[t0 op0 t1 ... = answer ]`` gets a role from the problem's structure:
``bos``, operand digit ``t{i}.p{k}`` (term ``i``, place ``k``; 0 = units), operand sign
``t{i}.sign`` (the ``N``), operator ``op{i}`` (between terms ``i`` and ``i+1``), ``=``, answer
digit ``ans.p{k}``, answer sign ``ans.sign``, ``eos``. The queries are the positions whose logits
predict an answer token; they are labelled by what they predict (``place``: ``ans.p{k}`` /
``ans.sign`` / ``eos``, aligned across answer lengths; or ``index``: ``a{j}``, j-th answer token).

A head attends *sparsely* when its largest attention weight from the query is at least
``threshold`` (default :data:`~interp_norm.core.defaults.SPARSE_THRESHOLD`, 0.95); the key it attends to is then recorded by role. Counting those events
over problems gives how often (``frequency`` = events / problems with that query) and how strongly
(``mean_strength`` = mean of the max weight) each head moves each role to each answer position.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import pandas as pd
import torch
from tqdm.auto import tqdm

from interp_norm.core import task as T
from interp_norm.circuits._types import device, require_eval
from interp_norm.core.defaults import SPARSE_THRESHOLD
from interp_norm.errors import PatchingError, check_positive_int
from interp_norm.core.hook_names import act_name

ROLE_ORDER = ("bos", "operand", "sign", "operator", "eq", "answer", "answer_sign", "eos")


def token_roles(problem: T.Problem) -> list[dict]:
    """One dict per token of ``problem.text``: ``label``, ``role``, ``term``, ``place``."""
    out: list[dict[str, Any]] = [dict(label="bos", role="bos", term=None, place=None)]
    for i, t in enumerate(problem.terms):
        if t < 0:
            out.append(dict(label=f"t{i}.sign", role="sign", term=i, place=None))
        digits = str(abs(t))
        for k, _ in enumerate(digits):
            place = len(digits) - 1 - k
            out.append(dict(label=f"t{i}.p{place}", role="operand", term=i, place=place))
        if i < len(problem.ops):
            out.append(dict(label=f"op{i}", role="operator", term=i, place=None))
    out.append(dict(label="=", role="eq", term=None, place=None))
    ans = T.format_int(problem.result)
    digits = ans.lstrip("N")
    if ans.startswith("N"):
        out.append(dict(label="ans.sign", role="answer_sign", term=None, place=None))
    for k, _ in enumerate(digits):
        out.append(dict(label=f"ans.p{len(digits) - 1 - k}", role="answer", term=None, place=len(digits) - 1 - k))
    out.append(dict(label="eos", role="eos", term=None, place=None))
    assert len(out) == len(problem.text)
    return out


def _problems(data) -> list[T.Problem]:
    if isinstance(data, T.Batch):
        return list(data.problems)
    if hasattr(data, "clean_problems") and data.clean_problems is not None:  # PatchingPairs
        return list(data.clean_problems)
    if isinstance(data, (str, T.Problem)):
        data = [data]
    try:
        return [p if isinstance(p, T.Problem) else T.parse_problem(p) for p in data]
    except TypeError:
        raise PatchingError("pass problems (strings or Problem objects), a task Batch or PatchingPairs") from None


@torch.no_grad()
def sparse_attention_events(model, problems, threshold: float = SPARSE_THRESHOLD, query: str = "place") -> pd.DataFrame:
    """One row per (problem, answer query, layer, head) whose max attention is >= ``threshold``:
    the query label, the key position and role it attends to, and the weight."""
    require_eval(model)
    if not 0 < threshold <= 1:
        raise PatchingError(f"threshold must be in (0, 1], got {threshold!r}")
    if query not in ("place", "index"):
        raise PatchingError(f"query must be 'place' or 'index', got {query!r}")
    probs = _problems(problems)
    if not probs:
        raise PatchingError("no problems given")
    L = model.cfg.n_layers
    tokens = T.pad_batch([T.encode(p.text) for p in probs]).to(device(model))
    if tokens.shape[1] > model.cfg.n_ctx:
        raise PatchingError(f"problems are {tokens.shape[1]} tokens long but the model's context is {model.cfg.n_ctx}")
    names = [act_name("pattern", l) for l in range(L)]
    _, cache = model.run_with_cache(tokens, names_filter=lambda nm: nm in names)
    pat = torch.stack([cache[nm] for nm in names])  # [L, b, H, q, k]
    roles = [token_roles(p) for p in probs]
    eq = [len(p.question) - 1 for p in probs]
    n_ans = [len(p.answer) for p in probs]
    A = max(n_ans)
    b = len(probs)
    qpos = torch.zeros(b, A, dtype=torch.long)
    qok = torch.zeros(b, A, dtype=torch.bool)
    for i in range(b):
        qpos[i, : n_ans[i]] = torch.arange(eq[i], eq[i] + n_ans[i])
        qok[i, : n_ans[i]] = True
    idx = qpos.to(pat.device).view(1, b, 1, A, 1).expand(L, b, pat.shape[2], A, pat.shape[-1])
    rows = pat.gather(3, idx)  # [L, b, H, A, k]
    mx, arg = rows.max(-1)
    hit = (mx >= threshold) & qok.to(pat.device).view(1, b, 1, A)
    out = []
    for l, i, h, j in hit.nonzero().tolist():
        q = int(qpos[i, j])
        target = roles[i][q + 1]["label"]  # what this query predicts
        kp = int(arg[l, i, h, j])
        r = roles[i][kp]
        out.append(dict(
            problem=i, answer_index=j, query=target if query == "place" else f"a{j}", query_pos=q,
            layer=l, head=h, key=r["label"], key_role=r["role"], key_term=r["term"], key_place=r["place"],
            key_pos=kp, offset=q - kp, strength=float(mx[l, i, h, j]),
        ))
    cols = ["problem", "answer_index", "query", "query_pos", "layer", "head", "key", "key_role", "key_term",
            "key_place", "key_pos", "offset", "strength"]
    df = pd.DataFrame(out, columns=cols)
    # how many problems have each query (denominator of the frequency)
    qlabels = []
    for i in range(b):
        for j in range(n_ans[i]):
            qlabels.append(roles[i][eq[i] + j + 1]["label"] if query == "place" else f"a{j}")
    df.attrs["query_counts"] = pd.Series(qlabels).value_counts().to_dict()
    return df


def _aggregate(events: pd.DataFrame, query_counts: dict) -> pd.DataFrame:
    cols = ["query", "layer", "head", "key", "key_role", "key_term", "key_place", "count", "n_queries", "frequency", "mean_strength"]
    if events.empty:
        return pd.DataFrame(columns=cols)
    g = events.groupby(["query", "layer", "head", "key"], dropna=False)
    agg = g.agg(
        key_role=("key_role", "first"), key_term=("key_term", "first"), key_place=("key_place", "first"),
        count=("strength", "size"), mean_strength=("strength", "mean"),
    ).reset_index()
    agg["n_queries"] = agg["query"].map(query_counts).astype(int)
    agg["frequency"] = agg["count"] / agg["n_queries"]
    return agg[cols].sort_values(["query", "layer", "head", "frequency"], ascending=[True, True, True, False]).reset_index(drop=True)


def attention_map(model, problems, threshold: float = SPARSE_THRESHOLD, query: str = "place") -> pd.DataFrame:
    """For every answer query, the heads that attend sparsely (max weight >= ``threshold``) and to
    which role, with ``count``, ``frequency`` (of the problems having that query) and ``mean_strength``.

    ``problems``: strings, :class:`~interp_norm.core.task.Problem` objects, a task ``Batch`` or
    ``PatchingPairs`` (their clean problems).
    """
    ev = sparse_attention_events(model, problems, threshold, query)
    return _aggregate(ev, ev.attrs["query_counts"])


def attention_map_split(
    model, task: Optional[T.AdditionTask] = None, split: Union[str, T.Split] = "id", n: int = 512, *,
    batch_size: int = 128, seed: int = 0, threshold: float = SPARSE_THRESHOLD, query: str = "place",
    progress: bool = False,
) -> pd.DataFrame:
    """:func:`attention_map` over ``n`` seeded problems of a split, in batches (``task``: the
    model's own unless given)."""
    task = T.task_for(model, task, who="attention_map_split")
    check_positive_int(n, "n", PatchingError)
    check_positive_int(batch_size, "batch_size", PatchingError)
    probs = task.sample_problems(n, split, seed)
    events: list = []
    counts: dict = {}
    for s in tqdm(range(0, n, batch_size), disable=not progress, desc="attention map"):
        ev = sparse_attention_events(model, probs[s : s + batch_size], threshold, query)
        ev["problem"] += s
        events.append(ev)
        for k, v in ev.attrs["query_counts"].items():
            counts[k] = counts.get(k, 0) + v
    ev = pd.concat(events, ignore_index=True) if events else pd.DataFrame()
    out = _aggregate(ev, counts)
    out.insert(0, "split", split if isinstance(split, str) else split.name)
    return out


__all__ = ["token_roles", "sparse_attention_events", "attention_map", "attention_map_split"]


# ----------------------------------------------------------------------------- attention patterns (for figures)


def attention_patterns(model, problems, name=None) -> pd.DataFrame:
    """The cached ``hook_pattern`` of each problem as a tidy table for the attention figures.

    ``problems``: strings (``"[12+N7="`` or a full ``"[12+N7=5]"``) or :class:`~interp_norm.core.task.Problem`;
    a question without answer is completed with the true answer, so the table shows the pattern
    while the answer is produced (teacher forcing). One row per (problem, layer, head, query, key)
    with ``key <= query``: ``weight``, ``q_token``, ``k_token``. ``name`` labels the model.
    :mod:`interp_norm.report.plots.attention` draws it (this runs the model, so it lives with the analyses).
    """
    import numpy as np

    from interp_norm.errors import ConfigError
    from interp_norm.core.hook_names import act_name

    if isinstance(problems, (str, T.Problem)):
        problems = [problems]
    if not problems:
        raise ConfigError("attention_patterns needs at least one problem, e.g. ['[12+N7=5]']")
    probs = [p if isinstance(p, T.Problem) else T.parse_problem(p) for p in problems]
    texts = [p.text for p in probs]
    cfg = model.cfg
    longest = max(len(t) for t in texts)
    if longest > cfg.n_ctx:
        raise ConfigError(f"a problem has {longest} tokens but the model's n_ctx is {cfg.n_ctx}; choose shorter problems")
    frames = []
    names = {act_name("pattern", l): l for l in range(cfg.n_layers)}
    with torch.no_grad():
        for i, text in enumerate(texts):
            tokens = T.encode(text)[None].to(model.W_E.device)
            _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in names)
            toks = list(text)
            qi, ki = np.tril_indices(len(toks))
            for hook, l in names.items():
                pat = cache[hook][0].double().cpu().numpy()  # h q k
                for h in range(cfg.n_heads):
                    frames.append(pd.DataFrame(dict(
                        problem=i, text=text, layer=l, head=h, query=qi, key=ki, weight=pat[h, qi, ki],
                        q_token=[toks[j] for j in qi], k_token=[toks[j] for j in ki],
                    )))
    df = pd.concat(frames, ignore_index=True)
    df.insert(0, "model", name if name is not None else cfg.attn_norm)
    return df


__all__ += ["attention_patterns"]
