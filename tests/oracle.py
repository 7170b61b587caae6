"""A slow, obviously-correct, per-token pure-Python statement of the Loops divergence semantics.

Rows are plain dicts of Python lists (``None`` allowed): ``logprobs``, ``mask``, ``trainer``,
optional ``advantages`` (length 1 or T), ``target_tokens`` and ``tokens`` (model_input ids).
The tests and the benchmark compare the package against this, token by token, the way the SDK
computes it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

PREFIX = "optim/train-sample-div/"


def _present(x: Any) -> bool:
    return x is not None and math.isfinite(x)


def action_tokens(rows: list[dict[str, Any]]) -> tuple[list[tuple[int, int, float, float]], int]:
    """(datum, position, sampler, trainer) of every active token, and the non-finite skips."""
    tokens, skipped = [], 0
    for i, row in enumerate(rows):
        n = len(row["logprobs"])
        advantages = row.get("advantages")
        if advantages is not None and len(advantages) == 1:
            advantages = advantages * n
        for k in range(n):
            mask = row["mask"][k]
            if mask is None or not mask > 0:
                continue
            if advantages is not None:
                a = advantages[k]
                if a is None or a == 0 or math.isnan(a):
                    continue
            s, t = row["logprobs"][k], row["trainer"][k]
            if not (_present(s) and _present(t)):
                skipped += 1
                continue
            tokens.append((i, k, float(s), float(t)))
    return tokens, skipped


def percentiles_pure_python(values: list[float], percents: list[float]) -> list[float]:
    """numpy's linear-method percentiles, in plain Python: a sort and an interpolation."""
    ordered = sorted(values)
    n = len(ordered)
    out = []
    for p in percents:
        virtual = (n - 1) * (p / 100)
        lower = min(math.floor(virtual), n - 1)
        upper = min(lower + 1, n - 1)
        a, b, gamma = ordered[lower], ordered[upper], virtual - lower
        out.append(b - (b - a) * (1 - gamma) if gamma >= 0.5 else a + (b - a) * gamma)
    return out


def metrics(rows: list[dict[str, Any]], *, pure_python: bool = False) -> dict[str, float]:
    """The metrics dict; ``pure_python`` takes percentiles with a Python sort instead of numpy."""
    tokens, skipped = action_tokens(rows)
    n = len(tokens)
    out = {"n_sequences": float(len(rows)), "n_skipped_nonfinite": float(skipped)}
    if n == 0:
        return {PREFIX + "n_action_tokens": 0.0, **{PREFIX + k: v for k, v in out.items()}}
    diffs = [t - s for _, _, s, t in tokens]
    weights = [math.exp(min(d, 80.0)) for d in diffs]
    abs_diffs = [abs(d) for d in diffs]
    per_datum: dict[int, list[float]] = {}
    for (i, _, _, _), d in zip(tokens, diffs):
        per_datum.setdefault(i, []).append(d)
    seq_means = [sum(v) / len(v) for v in per_datum.values()]
    seq_weights = [math.exp(min(m, 80.0)) for m in seq_means]
    if pure_python:
        p50, p90, p99 = percentiles_pure_python(abs_diffs, [50, 90, 99])
    else:
        p50, p90, p99 = np.percentile(abs_diffs, [50, 90, 99])
    sw, sw2 = sum(weights), sum(w * w for w in weights)
    out.update(
        {
            "kl_sample_train_v1_loops": sum(s - t for _, _, s, t in tokens) / n,
            "kl_sample_train_v2_loops": 0.5 * sum(d * d for d in diffs) / n,
            "kl_sample_train_k3": sum(w - 1 - d for w, d in zip(weights, diffs)) / n,
            "is_ratio_mean": sw / n,
            "ess_fraction": sw * sw / (n * sw2) if n * sw2 != 0 else 0.0,
            "diff_mean": sum(diffs) / n,
            "diff_abs_p50": float(p50),
            "diff_abs_p90": float(p90),
            "diff_abs_p99": float(p99),
            "diff_abs_max": max(abs_diffs),
            "frac_abs_gt_1": sum(a > 1 for a in abs_diffs) / n,
            "frac_abs_gt_2": sum(a > 2 for a in abs_diffs) / n,
            "frac_abs_gt_4": sum(a > 4 for a in abs_diffs) / n,
            "entropy": -sum(s for _, _, s, _ in tokens) / n,
            "n_action_tokens": float(n),
            "is_ratio_max": max(weights),
            "is_ratio_min": min(weights),
            "chi2_token": sw2 / n - 1,
            "seq_log_ratio_mean": sum(seq_means) / len(seq_means),
            "seq_is_ratio_mean": sum(seq_weights) / len(seq_weights),
            "seq_is_ratio_max": max(seq_weights),
            "frac_is_ratio_gt_2": sum(w > 2 for w in weights) / n,
            "frac_is_ratio_lt_0.5": sum(w < 0.5 for w in weights) / n,
            "frac_abs_gt_0.5": sum(a > 0.5 for a in abs_diffs) / n,
        }
    )
    return {PREFIX + k: float(v) for k, v in out.items()}


def rows_from_datums(data: list[Any], trainer: list[Any]) -> list[dict[str, Any]]:
    """Read datums field by field into Python lists, as a per-token implementation must first."""

    def values(field: Any) -> list[Any]:
        data_ = getattr(field, "data", None)
        return list(data_) if isinstance(data_, list) else field.tolist()

    rows = []
    for datum, row_trainer in zip(data, trainer):
        inputs = datum.loss_fn_inputs
        row = {key: values(inputs[key]) for key in ("logprobs", "mask", "advantages", "target_tokens") if key in inputs}
        row["trainer"] = values(row_trainer)
        row["tokens"] = datum.model_input.to_ints()
        rows.append(row)
    return rows


def histogram(rows: list[dict[str, Any]], max_tokens: int = 50000) -> list[float]:
    diffs = [t - s for _, _, s, t in action_tokens(rows)[0]]
    n = len(diffs)
    if max_tokens <= 0 or n <= max_tokens:
        return diffs
    m = max_tokens
    return [diffs[round(i * (n - 1) / (m - 1))] for i in range(m)] if m > 1 else diffs[:1]


def _text(ids: list[int], tokenizer: Any) -> str:
    if not ids:
        return ""
    try:
        text = tokenizer.decode(ids) if tokenizer is not None else None
    except Exception:
        text = None
    if text is None:
        text = " ".join(map(str, ids))
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")


def _token_text(token: int, tokenizer: Any) -> str:
    """The SDK's token cell: ``tokenizer.decode([id])``, or the id as a decimal string."""
    try:
        return str(tokenizer.decode([token])) if tokenizer is not None else str(token)
    except Exception:
        return str(token)


def worst_rows(rows: list[dict[str, Any]], top_n: int = 20, tokenizer: Any = None) -> list[list[Any]]:
    tokens = action_tokens(rows)[0]
    ranked = sorted(tokens, key=lambda tok: -abs(tok[3] - tok[2]))  # stable: earlier tokens first on ties
    table = []
    for rank, (i, k, s, t) in enumerate(ranked[:top_n], start=1):
        row = rows[i]
        ids = row.get("tokens") or []
        if row.get("target_tokens") is not None:
            token: Any = int(row["target_tokens"][k])
        elif k + 1 < len(ids):
            token = ids[k + 1]
        else:
            token = "<end>"
        column = token if token == "<end>" else _token_text(token, tokenizer)
        p = k + 1
        # The context is model_input's alone: the id at p between » «, ``<end>`` past its end,
        # whatever target_tokens[k] holds (the ``token`` column).
        before, after = ids[max(0, p - 40) : p], ids[p + 1 : p + 21]
        centre = _text([ids[p]], tokenizer) if p < len(ids) else "<end>"
        context = (
            _text(before[:-3], tokenizer) + "⟦" + _text(before[-3:], tokenizer) + "»" + centre + "«"
            + _text(after[:3], tokenizer) + "⟧" + _text(after[3:], tokenizer)
        )
        d = t - s
        table.append([rank, i, p, column, round(s, 4), round(t, 4), round(d, 4), round(math.exp(min(d, 80.0)), 4), context])
    return table
