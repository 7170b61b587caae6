"""What the monitor says about a logged step's inputs, once per run and problem, on rank 0.

Everything here is read from the step's report and its reduced statistics (every micro-batch and
rank together, after the step's one host transfer), so a problem on another rank, or on an
accelerator where nothing was read per micro-batch, is said too: logprobs and entropies no sampled
token can have (``guard_rail.impossible_inputs``, with an example position), a ``max_sampling_z``
without the entropies, NaN advantages, a
correction without advantages, versions ahead of the trainer, group ids pooled in ``group_other``,
a per-datum key usable for only part of the step's tokens, and a run watching nothing.

Examples:
    >>> from loops_callbacks.divergence.batch import data_keys
    >>> from loops_callbacks.run_warnings import RunWarnings
    >>> from types import SimpleNamespace
    >>> host = SimpleNamespace(totals={"n_action_tokens": 4.0}, strata={"lag_0": SimpleNamespace(n_tokens=4.0)},
    ...                        by_lag={"0": SimpleNamespace(n_tokens=4.0)})
    >>> partial_keys(RunWarnings(), data_keys(None), host, step=3)  # every token had a version: nothing to say
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from loops_callbacks.divergence.batch import LOGPROB_FLOOR, FlatBatch
from loops_callbacks.divergence.batch import key_label
from loops_callbacks.divergence.report import StepReport
from loops_callbacks.divergence.statistics import no_advantage_message
from loops_callbacks.divergence.statistics import AHEAD_STRATUM
from loops_callbacks.divergence.statistics import HostDivergence
from loops_callbacks.divergence.statistics import sampling_positions
from loops_callbacks.run_warnings import RunWarnings
from loops_callbacks.validation import LOGPROB_ROUNDING

WATCHING_NOTHING_AFTER = 3
"""Logged steps without action tokens, from the start of a run, before the monitor says so."""


def about_step(say: RunWarnings, keys: Mapping[str, str], report: StepReport, host: HostDivergence,
               flat: FlatBatch | None, step: int, *, max_groups: int, max_sampling_z: float | None) -> None:
    """Every warning of the module docstring that this step calls for (``flat``: its last micro-batch)."""
    for problem, message in report.problems.items():
        if not say.said(problem):  # the example costs a search of the micro-batch: once
            say.warn(problem, f"KLSampleTrainMonitor, step {step}: {message} ({_example(problem, keys, flat)})")
    if max_sampling_z is not None and report.has_action_tokens and not host.totals["n_sampling_given"]:
        entropies = [keys[name] for name in ("training_entropy", "training_varentropy")]
        say.warn("sampling_z:missing", f"KLSampleTrainMonitor, step {step}: max_sampling_z = {max_sampling_z:g} is "
                 f"set but the step has no {entropies[0]!r} and {entropies[1]!r} (token_logprobs(..., "
                 "with_entropy=True) returns them): what was sampled is not checked")
    label = key_label(keys, "advantages")
    for key, message in ((f"advantages_nan:{keys['advantages']}", nan_advantages_message(host.totals, label)),
                         ("advantages_unusable", no_advantage_message(host.totals, host.extrema, label))):
        if message is not None:
            say.warn(key, f"KLSampleTrainMonitor, step {step}: {message}")
    if host.strata is None:
        return
    ahead = host.strata[AHEAD_STRATUM].n_tokens
    if ahead:  # what per_datum could not say on an accelerator
        say.warn("policy_version:ahead", f"KLSampleTrainMonitor, step {step}: {int(ahead)} action tokens are of "
                 f"datums whose {keys['policy_version']!r} is ahead of the trainer's optimizer step; they are counted "
                 f"at lag 0 and in the stratum {AHEAD_STRATUM!r} (versions must count the trainer's optimizer steps, "
                 "0 for the initial weights)")
    partial_keys(say, keys, host, step)
    if "group_other" in host.strata:  # only groups with tokens are there
        say.warn("group_other", f"KLSampleTrainMonitor, step {step}: datums with {keys['group']!r} >= max_groups = "
                 f"{max_groups} (or negative) are pooled in the stratum 'group_other'; raise max_groups to see them "
                 "apart")


def nan_advantages_message(totals: Mapping[str, float], label: str) -> str | None:
    """What to say about advantages holding NaN on masked-in positions (every micro-batch and rank
    together); ``None`` when there are none. ``label`` names the advantages key (``inputs.key_label``).

    Examples:
        >>> nan_advantages_message({"n_advantage_nan": 2.0, "n_masked_in": 30.0}, "'advantages'").split(";")[0]
        "'advantages' holds NaN on 2 of the 30 masked-in positions (mask > 0) of the step, all ranks together"
    """
    if not totals["n_advantage_nan"] > 0:
        return None
    return (
        f"{label} holds NaN on {int(totals['n_advantage_nan'])} of the {int(totals['n_masked_in'])} masked-in "
        "positions (mask > 0) of the step, all ranks together; a NaN advantage counts as 0, so those tokens are not "
        "action tokens: the monitor's numbers leave them out, and a correction that needs advantages reads each "
        "datum's without them (0 where none is left)"
    )


def partial_keys(say: RunWarnings, keys: Mapping[str, str], host: Any, step: int) -> None:
    """Say once per run that a per-datum key covered only part of the step's action tokens: each rank turns a
    key it cannot use off for its own datums, and only rank 0 warns; the global sums still show it."""
    tokens = host.totals["n_action_tokens"]
    families = {
        "policy_version": sum(stratum.n_tokens for stratum in host.by_lag.values()),
        "group": sum(host.strata[name].n_tokens for name in host.strata if name.startswith("group_")),
    }
    for name, covered in families.items():
        if 0 < covered < tokens:
            say.warn(f"{name}:partial", f"KLSampleTrainMonitor, step {step}: {keys[name]!r} was usable for "
                     f"{int(covered)} of the step's {int(tokens)} action tokens (all ranks together); the rest are not "
                     "in its strata. A rank or datum gave it in a form the monitor could not read (every rank must "
                     "give it for every datum)")


def watching_nothing(say: RunWarnings, keys: Mapping[str, str], logged_steps: int) -> None:
    say.warn("watching_nothing", f"KLSampleTrainMonitor: none of the {logged_steps} logged step(s) had an action "
             f"token ({keys['mask']!r} > 0 with a non-zero {keys['advantages']!r}); the monitor is watching nothing — "
             "check the mask (1.0 on the tokens the policy sampled) and the advantages")


def _example(problem: str, keys: Mapping[str, str], flat: FlatBatch | None) -> str:
    """Where one offending value sits in the step's last micro-batch, and under which key."""
    side, _, kind = problem.partition("_")
    if side in ("sampler", "trainer"):
        key = keys["logprobs"] if side == "sampler" else keys["training_logprobs"]
        if kind == "all_zero" or flat is None:
            return f"key {key!r}"
        values = flat.sampler if side == "sampler" else flat.trainer
        found = {"above_zero": flat.active & (values > LOGPROB_ROUNDING), "below_floor": flat.active & (
            values < LOGPROB_FLOOR), "neg_inf": flat.counted & (values == -math.inf),
            "pos_inf": flat.counted & (values == math.inf)}[kind]
        return _place(f"key {key!r}", found, flat, [values])
    names = ["training_entropy"] if side == "entropy" else ["training_varentropy"] if side == "varentropy" else [
        "training_logprobs", "training_entropy", "training_varentropy"]
    label = f"key {keys[names[0]]!r}" if len(names) == 1 else "keys " + ", ".join(repr(keys[n]) for n in names)
    positions = None if flat is None else sampling_positions(flat)
    if positions is None or problem == "sampling_unscaled":
        return label
    found = positions["sampling_ruled_out"] if side == "sampling" else (
        positions[f"{side}_nan"] | positions[f"{side}_inf"] | positions[f"{side}_negative"])
    fields = {"training_logprobs": flat.trainer, "training_entropy": flat.entropy, "training_varentropy": flat.varentropy}
    return _place(label, found, flat, [fields[name] for name in names])


def _place(label: str, found: torch.Tensor, flat: FlatBatch, values: list[torch.Tensor]) -> str:
    """``label``, with the first ``found`` position's ``values``, datum and position in the last micro-batch."""
    hits = torch.nonzero(found)
    if hits.numel() == 0:
        return f"{label}, in an earlier micro-batch of the step"
    index = int(hits[0, 0])
    ends = torch.cumsum(flat.row_lengths, 0).cpu()
    datum = int(torch.searchsorted(ends, index, right=True))
    position = index - (int(ends[datum - 1]) if datum else 0)
    shown = ", ".join(f"{float(x[index]):.3g}" for x in values)
    return f"{label}, e.g. {shown} at datum {datum}, position {position} of the last micro-batch"
