"""One logged step's report, built once from its host statistics: what the sinks deliver and the guard rail judges.

``step_report`` is a pure function of the statistics and the options: the metrics (the Loops SDK's
scalars), the likely cause, the breakdown (the diagnosis', the strata's and the corrections' shadow
scalars), the media (the histogram's values, the worst-tokens rows, the strata rows, the same for
every logger), what is impossible about the inputs, and the guard rail's judgement. Names are bare;
the prefix is added when delivering.

Examples:
    >>> import torch
    >>> from loops_callbacks.divergence.flat_batch import flatten_padded
    >>> from loops_callbacks.divergence.statistics import DivergenceStats
    >>> flat = flatten_padded(sampler_logprobs=torch.tensor([[-1.0, -2.0]]),
    ...                       training_logprobs=torch.tensor([[-1.5, -2.0]]), mask=torch.ones(1, 2))
    >>> report = step_report(DivergenceStats.from_batch(flat).to_host(), prefix="div/", media=MediaOptions(),
    ...                      guard_rail=GuardRail(max_kl=0.05), diagnose=True)
    >>> report.scalars["kl_sample_train_v1_loops"], report.diagnosis.cause, report.exceeds
    (0.25, 'unclear', 'div/kl_sample_train_k3 = 0.0532653 exceeded max_kl = 0.05')
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from loops_callbacks.correction import Correction
from loops_callbacks.divergence.causes import Diagnosis, diagnosis_metrics
from loops_callbacks.divergence.diagnosis import diagnose as likely_cause
from loops_callbacks.divergence.evidence import DirectEvidence, SamplerFacts
from loops_callbacks.divergence.flat_batch import NO_TOKEN
from loops_callbacks.divergence.guard_rail import GuardRail, impossible_inputs
from loops_callbacks.divergence.per_datum import DEFAULT_MAX_GROUPS
from loops_callbacks.divergence.prompts import prompt_finding
from loops_callbacks.divergence.metrics import STRATUM_METRICS, histogram_values, is_ratio, scalar_metrics, stratum_scalars
from loops_callbacks.divergence.shadow import shadow_scalars
from loops_callbacks.divergence.signatures import server_numbers, signature_numbers
from loops_callbacks.divergence.statistics import HostDivergence
from loops_callbacks.divergence.states import MASK_ROW, ROW
from loops_callbacks.validation import check, check_bool, check_int

WORST_TOKEN_COLUMNS = ["rank", "datum", "position", "token", "logp_sampler", "logp_trainer", "diff", "is_weight",
                       "context"]
STRATA_COLUMNS = ("stratum",) + STRATUM_METRICS
END, NEAR = "<end>", 3
HISTOGRAM_KEY, TABLE_KEY, STRATA_TABLE_KEY, DIAGNOSIS_KEY = "per_token_diff_hist", "worst_tokens", "strata", "diagnosis"


@runtime_checkable
class Tokenizer(Protocol):
    """Anything with ``decode(list[int]) -> str``, e.g. a Hugging Face tokenizer."""

    def decode(self, token_ids: list[int]) -> str: ...


@dataclass(frozen=True)
class MediaOptions:
    """What the monitor logs beside the scalars (``KLSampleTrainMonitor(media=...)``).

    ``log_histogram``: the per-token diff histogram (W&B, TensorBoard), of at most ``max_histogram_tokens``
    diffs, evenly subsampled (<= 0: no cap). ``log_worst_tokens``: the worst-divergent-tokens table (W&B table,
    TensorBoard text) of ``top_n`` rows. ``log_strata``: the divergence by stratum (by sampler probability, by
    quartile of each datum's action tokens, by policy lag and by group); ``max_groups`` groups are kept apart
    (ids ``0`` to ``max_groups - 1``), larger ids pooled in ``group_other``.
    """

    log_histogram: bool = True
    max_histogram_tokens: int = 50000
    log_worst_tokens: bool = True
    top_n: int = 20
    log_strata: bool = True
    max_groups: int = DEFAULT_MAX_GROUPS

    def __post_init__(self) -> None:
        for name in ("log_histogram", "log_worst_tokens", "log_strata"):
            check_bool(name, getattr(self, name))
        check_int("max_histogram_tokens", self.max_histogram_tokens, least=None, what=" (<= 0: no cap)")
        check_int("top_n", self.top_n, least=0)
        check_int("max_groups", self.max_groups, least=1)

    @property
    def rows(self) -> int:
        """The worst rows the statistics keep: none without the table."""
        return self.top_n if self.log_worst_tokens else 0

    @property
    def strata_groups(self) -> int | None:
        """The groups the statistics keep apart: ``None`` without strata."""
        return self.max_groups if self.log_strata else None


def checked_tokenizer(tokenizer: Tokenizer | None) -> Tokenizer | None:
    """``tokenizer`` if it is ``None`` or has a ``decode`` method; a ``TypeError`` otherwise."""
    return check("tokenizer", tokenizer, Tokenizer, "a tokenizer with a decode(list[int]) method", optional=True)


@dataclass(frozen=True)
class StepReport:
    """Everything one logged step says (module docstring); every name without the prefix."""

    scalars: dict[str, float]
    diagnosis: Diagnosis | None = None
    breakdown: dict[str, float] = field(default_factory=dict)
    signatures: dict[str, float] = field(default_factory=dict)  # the numbers the diagnosis read
    histogram: np.ndarray | None = None
    tables: dict[str, tuple[Sequence[str], list[list[Any]]]] = field(default_factory=dict)  # key: (columns, rows)
    problems: dict[str, str] = field(default_factory=dict)  # impossible inputs, by a stable key
    exceeds: str | None = None  # why the step exceeds the guard rail; None: it does not (or no bound)
    untrusted: str | None = None  # why the numbers cannot be trusted, bound or not

    @property
    def has_action_tokens(self) -> bool:
        """Whether the step had masked-in action tokens, finite or not (something to judge)."""
        return self.scalars["n_action_tokens"] + self.scalars["n_skipped_nonfinite"] > 0


def step_report(
    host: HostDivergence,
    *,
    prefix: str,
    media: MediaOptions,
    guard_rail: GuardRail,
    diagnose: bool,
    tokenizer: Tokenizer | None = None,
    corrections: Sequence[Correction] = (),
    noise_floor: float | None = None,
    evidence: DirectEvidence | None = None,
    facts: SamplerFacts | None = None,
    trend: Sequence[float] = (),
    sampling_trend: Sequence[float] = (),
    max_policy_lag: int = 0,
    servers: Sequence[str] = (),
) -> StepReport:
    """The report of the step whose statistics are ``host``.

    ``diagnose`` names the likely cause (impossible inputs first: the statistical rule would read them
    as something else), from ``noise_floor`` (the run's, ``history.Calibration``), ``evidence`` (what was
    seen of the trainer), ``facts`` (what the sampling engine says), the step's ``host.by_lag`` and ``trend``
    (the relative gaps of the run's previous logged steps, oldest first; ``sampling_trend`` their sampling z),
    ``max_policy_lag`` (the lag the run intends) and ``servers`` (the sampling servers' URLs in slot order: the
    divergence by server, ``server/<slot>/...``, and a server behind named); ``tokenizer`` shows the worst tokens and a differing prompt as text.
    """
    refuse_mask(host)
    scalars = scalar_metrics(host, prefix="")
    problems, n = impossible_inputs(host), host.totals["n_action_tokens"]
    diagnosis, signatures, breakdown = None, {}, {}
    by_server = server_numbers(host, servers) if n > 0 else {}
    if diagnose and n > 0:
        signatures = signature_numbers(host)
        diagnosis = Diagnosis.impossible_inputs(problems.values()) if problems else likely_cause(
            signatures, n_tokens=n, noise_floor=noise_floor, evidence=evidence, facts=facts, by_lag=host.by_lag,
            trend=trend, sampling_trend=sampling_trend, max_policy_lag=max_policy_lag, by_server=by_server,
            prompt=prompt_finding(host.totals, host.arrays, lambda ids: escape(_decoded(ids, tokenizer))),
        )
        breakdown = diagnosis_metrics(diagnosis, signatures, prefix="")
    strata = host.strata if host.strata is not None and n > 0 else {}
    breakdown |= stratum_scalars(strata) | shadow_scalars(host.totals, host.extrema, corrections)
    breakdown |= {f"server/{slot}/{name}": value for slot, server in by_server.items()
                  for name, value in server._asdict().items() if name != "url"}
    logs_histogram = n and media.log_histogram and host.diffs.size
    histogram = histogram_values(host.diffs, media.max_histogram_tokens) if logs_histogram else None
    tables = {}
    if n and media.log_worst_tokens:
        tables[TABLE_KEY] = (WORST_TOKEN_COLUMNS, worst_token_rows(host.worst, tokenizer))
    strata_rows = [[name, *(float(getattr(s, metric)) for metric in STRATUM_METRICS)]
                   for name, s in strata.items() if s.n_tokens]
    if strata_rows:
        tables[STRATA_TABLE_KEY] = (STRATA_COLUMNS, strata_rows)
    return StepReport(
        scalars, diagnosis, breakdown, signatures, histogram, tables,
        problems=problems,
        exceeds=guard_rail.exceeds(scalars, host, prefix=prefix, facts=facts),
        untrusted=guard_rail.untrusted(scalars, host, facts),
    )


def refuse_mask(host: HostDivergence) -> None:
    """A ``ValueError`` when the step's mask held negative or NaN values where it was not read per micro-batch (an
    accelerator: ``flat_batch``), naming how many and the first, as any mask read on the CPU is refused."""
    refused = host.totals.get("n_mask_refused", 0.0)
    if not refused:
        return
    row, position = divmod(int(-host.extrema["neg_min_mask_refused_at"]), MASK_ROW)
    raise ValueError(
        f"'mask' holds {refused:.0f} negative or NaN values on this step (all micro-batches and ranks together), "
        f"the first at row {row}, position {position} of one of its micro-batches (the row is the datum, for a list "
        "of Datum). A mask is 1.0 on the action "
        "tokens and 0.0 elsewhere (or bools, or weights >= 0): a negative or NaN value would drop its token without a "
        "word (read on the device, it is refused after the step's one host transfer)"
    )


def wandb_media(report: StepReport, prefix: str) -> dict[str, Any]:
    """The report's media as W&B objects (``wandb`` is imported only when there are some): the histogram,
    the worst-tokens and strata tables (one type per column: the token column is text), the diagnosis as HTML."""
    if report.histogram is None and not report.tables and report.diagnosis is None:
        return {}
    import wandb

    media = {} if report.histogram is None else {
        prefix + HISTOGRAM_KEY: wandb.Histogram(np_histogram=histogram_bins(report.histogram))}
    media |= {prefix + key: wandb.Table(columns=list(columns), data=rows)
              for key, (columns, rows) in report.tables.items()}
    if report.diagnosis is not None:
        media[prefix + DIAGNOSIS_KEY] = html_panel(report.diagnosis.message)
    return media


def histogram_bins(values: Any, bins: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """``np.histogram(values, bins)``, as ``wandb.Histogram`` makes it, but for values a few ulps apart, where numpy
    cannot make finite bins: those are centred in a range of 1 (as numpy does for equal values), or of ``bins`` ulps
    where 1 is less than that (|values| above about 1e13, sentinels).

    Examples:
        >>> counts, edges = histogram_bins(np.array([1.9030763833634445, 1.903076383363444]))
        >>> int(counts.sum()), len(edges), float(edges[0]) < 1.9030763833634445 < float(edges[-1])
        (2, 65, True)
        >>> int(histogram_bins(np.array([-1e15, -1e15 + 0.25]))[0].sum())
        2
    """
    values = np.asarray(values, dtype=np.float64)
    try:
        return np.histogram(values, bins=bins)
    except ValueError:  # "Too many bins for data range": the range is finite but below bins ulps
        middle = float(values.min()) / 2 + float(values.max()) / 2
        half = max(0.5, bins * float(np.spacing(abs(middle))), float(values.max()) - middle)
        return np.histogram(values, bins=bins, range=(middle - half, middle + half))


def html_panel(text: str) -> Any:
    """A ``wandb.Html`` panel showing ``text`` as it is."""
    import wandb

    return wandb.Html(f"<pre>{html.escape(text)}</pre>")


def worst_token_rows(worst: np.ndarray, tokenizer: Tokenizer | None = None) -> list[list[Any]]:
    """The worst-tokens table's rows, rank 1 first, as in the Loops SDK.

    ``position`` is k + 1 (the position in ``model_input`` of the token predicted at k); ``token`` is
    text: ``tokenizer.decode([id])``, the id without a tokenizer (or one that cannot decode it), ``"<end>"``
    for none; ``is_weight`` is exp(min(d, 80)); ``context`` is ``model_input`` alone around index k + 1
    (``format_context``): at a datum's last position ``»<end>«`` whatever the target.

    Example (the last position of a datum ``[7, 8]`` whose target there is 9):
        >>> row = np.full(ROW.WIDTH, -1.0)
        >>> row[:7] = [2.0, -2.0, -0.5, -2.5, 0, 1, 9]
        >>> row[ROW.BEFORE][-2:] = [7, 8]
        >>> worst_token_rows(row[None, :])
        [[1, 0, 2, '9', -0.5, -2.5, -2.0, 0.1353, '⟦7 8»<end>«⟧']]
    """
    rows = []
    for rank, row in enumerate(worst, start=1):
        diff, after = float(row[ROW.DIFF]), row[ROW.AFTER]
        rows.append([
            rank, int(row[ROW.DATUM]), int(row[ROW.POSITION]) + 1, token_text(int(row[ROW.TOKEN]), tokenizer),
            round(float(row[ROW.SAMPLER]), 4), round(float(row[ROW.TRAINER]), 4), round(diff, 4),
            round(is_ratio(diff), 4), format_context(_ids(row[ROW.BEFORE]), int(after[0]), _ids(after[1:]), tokenizer),
        ])
    return rows


def format_context(before: list[int], centre: int, after: list[int], tokenizer: Tokenizer | None) -> str:
    """``before⟦near»centre«near⟧after``, "near" being the 3 tokens on each side; text escaped.

    Examples:
        >>> format_context([1, 2, 3, 4], 5, [6, 7, 8, 9], None), format_context([1, 2], NO_TOKEN, [], None)
        ('1⟦2 3 4»5«6 7 8⟧9', '⟦1 2»<end>«⟧')
    """
    shown = END if centre == NO_TOKEN else _text([centre], tokenizer)
    return (f"{_text(before[:-NEAR], tokenizer)}⟦{_text(before[-NEAR:], tokenizer)}»{shown}"
            f"«{_text(after[:NEAR], tokenizer)}⟧{_text(after[NEAR:], tokenizer)}")


def token_text(token: int, tokenizer: Tokenizer | None) -> str:
    """The ``token`` column: ``tokenizer.decode([token])``, else ``str(token)``; ``"<end>"`` for no token.

    Examples:
        >>> token_text(49947, None), token_text(-1, None)
        ('49947', '<end>')
    """
    return END if token == NO_TOKEN else _decoded([token], tokenizer)


def _ids(values: np.ndarray) -> list[int]:
    return [int(v) for v in values if v != NO_TOKEN]


def _text(ids: list[int], tokenizer: Tokenizer | None) -> str:
    return escape(_decoded(ids, tokenizer)) if ids else ""


def _decoded(ids: list[int], tokenizer: Tokenizer | None) -> str:
    """``tokenizer.decode(ids)``; the ids, space-separated, without a tokenizer or one that cannot decode them."""
    if tokenizer is not None:
        try:
            return str(tokenizer.decode(ids))
        except Exception:  # a tokenizer that cannot decode these ids: the ids, as without one
            pass
    return " ".join(map(str, ids))


def escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
