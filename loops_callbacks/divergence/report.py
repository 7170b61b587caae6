"""A logged step's report (``StepReport``), its rendering for every logger (scalars, W&B media, HTML, Markdown and
plain text), and what the monitor says about the step's inputs, once per run.

One logged step's report, built once from its host statistics: what is delivered and what the guard rail judges.

``step_report`` is a pure function of the statistics and the options: the metrics (the Loops SDK's
scalars), the likely cause, the breakdown (the diagnosis', the strata's and the corrections' shadow
scalars), the media (the histogram's values, the worst-tokens rows, the strata rows, the same for
every logger), what is impossible about the inputs, and the guard rail's judgement. Names are bare;
the prefix is added when delivering.

Examples:
    >>> import torch
    >>> from loops_callbacks.divergence.batch import flatten_padded
    >>> from loops_callbacks.divergence.statistics import DivergenceStats
    >>> flat = flatten_padded(sampler_logprobs=torch.tensor([[-1.0, -2.0]]),
    ...                       training_logprobs=torch.tensor([[-1.5, -2.0]]), mask=torch.ones(1, 2))
    >>> report = step_report(DivergenceStats.from_batch(flat).to_host(), ReportOptions(prefix="div/"),
    ...                      guard_rail=GuardRail(max_kl=0.05))
    >>> report.scalars["kl_sample_train_v1_loops"], report.diagnosis.cause, report.exceeds
    (0.25, 'unclear', 'div/kl_sample_train_k3 = 0.0532653 exceeded max_kl = 0.05')

Deliver a step's report to every Lightning logger, each in its own way, in one record per step.

* ``WandbLogger``: the scalars and the breakdown with a ``wandb.Histogram``, the worst-tokens and strata
  ``wandb.Table``s and the diagnosis as HTML, in one ``log_metrics`` call (never ``run.log(step=...)``,
  which W&B silently drops once its own counter is ahead);
* ``TensorBoardLogger``: the scalars, ``add_histogram``, and the tables and the diagnosis as Markdown text;
* any other logger (CSV, MLflow, ...): the scalars.

The media are the report's, built once for every logger. A logger that fails is a warning (once per run
and logger) and is skipped: monitoring never stops training. ``deliver_text`` writes one text (the guard
rail's message, the run's summary) to each logger that can show text.

Examples:
    >>> from loops_callbacks.divergence.report import StepReport
    >>> class Printer:
    ...     def log_metrics(self, metrics, step):
    ...         print(step, metrics)
    >>> deliver([Printer()], StepReport({"n_action_tokens": 0.0}), step=3, prefix="div/")
    3 {'div/n_action_tokens': 0.0}

What the monitor says about a logged step's inputs, once per run and problem, on rank 0.

Everything here is read from the step's report and its reduced statistics (every micro-batch and
rank together, after the step's one host transfer), so a problem on another rank, or on an
accelerator where nothing was read per micro-batch, is said too: logprobs and entropies no sampled
token can have (``guard_rail.impossible_inputs``, with an example position), a ``max_sampling_z``
without the entropies, NaN advantages, a
correction without advantages, versions ahead of the trainer, group ids pooled in ``group_other``,
and a per-datum key usable for only part of the step's tokens (a run watching nothing is the guard rail's to say).

Examples:
    >>> from loops_callbacks.divergence.batch import data_keys
    >>> from loops_callbacks.run_warnings import RunWarnings
    >>> from types import SimpleNamespace
    >>> host = SimpleNamespace(totals={"n_action_tokens": 4.0}, strata={"lag_0": SimpleNamespace(n_tokens=4.0)},
    ...                        by_lag={"0": SimpleNamespace(n_tokens=4.0)})
    >>> partial_keys(RunWarnings(), data_keys(None), host, step=3)  # every token had a version: nothing to say
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from loops_callbacks.correction import Correction
from loops_callbacks.divergence.batch import (
    DEFAULT_MAX_GROUPS, LOGPROB_FLOOR, NO_TOKEN, DirectEvidence, FlatBatch, SamplerFacts, key_label,
)
from loops_callbacks.divergence.diagnosis import Calibration, Diagnosis, diagnosis_metrics
from loops_callbacks.divergence.diagnosis import diagnose as likely_cause
from loops_callbacks.divergence.guard_rail import GuardRail, impossible_inputs
from loops_callbacks.divergence.statistics import (
    AHEAD_STRATUM, MASK_ROW, PROMPT_CONTEXT, PROMPT_RECORD, PROMPT_SCALE, RECORD, ROW, STRATUM_METRICS,
    HostDivergence, histogram_values, is_ratio, no_advantage_message, sampling_positions, scalar_metrics,
    parse_corrections, server_numbers, shadow_scalars, signature_numbers, stratum_scalars,
)
from loops_callbacks.run_warnings import RunWarnings
from loops_callbacks.validation import LOGPROB_ROUNDING, check, check_bool, check_int

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
class ReportOptions:
    """What ``step_report`` says, checked once when made: the media ``media`` asks for; the likely cause when
    ``diagnose``; the worst tokens and a differing prompt as text with ``tokenizer``; the shadow statistics of
    ``corrections`` (specs or parsed ones: ``parse_corrections``); ``max_policy_lag``, the lag the run intends;
    ``prefix``, the metrics' prefix the guard rail's message names.

    >>> ReportOptions(diagnose=False).media.top_n
    20
    """

    media: MediaOptions = MediaOptions()  # noqa: RUF009 - frozen
    diagnose: bool = True
    tokenizer: Tokenizer | None = None
    corrections: tuple[Correction, ...] = ()
    max_policy_lag: int = 0
    prefix: str = ""

    def __post_init__(self) -> None:
        check("media", self.media, MediaOptions, "a MediaOptions")
        check_bool("diagnose", self.diagnose)
        checked_tokenizer(self.tokenizer)
        object.__setattr__(self, "corrections", parse_corrections(self.corrections))  # specs, or parsed already
        check_int("max_policy_lag", self.max_policy_lag, least=0)
        check("prefix", self.prefix, str, "a str")


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
    options: ReportOptions = ReportOptions(),  # noqa: B008 - frozen
    *,
    guard_rail: GuardRail,
    calibration: Calibration | None = None,
    evidence: DirectEvidence | None = None,
    facts: SamplerFacts | None = None,
    servers: Sequence[str] = (),
) -> StepReport:
    """The report of the step whose statistics are ``host``, as ``options`` say.

    The likely cause (impossible inputs first: the statistical rule would read them as something else) comes from
    ``calibration`` (the run's noise floor and the trend of its previous logged steps), ``evidence`` (what was seen
    of the trainer), ``facts`` (what the sampling engine says), the step's ``host.by_lag`` and ``servers`` (the
    sampling servers' URLs in slot order: the divergence by server, ``server/<slot>/...``, and a server behind
    named).
    """
    media, tokenizer, corrections = options.media, options.tokenizer, options.corrections
    refuse_mask(host)
    scalars = scalar_metrics(host, prefix="")
    problems, n = impossible_inputs(host), host.totals["n_action_tokens"]
    diagnosis, signatures, breakdown = None, {}, {}
    by_server = server_numbers(host, servers) if n > 0 else {}
    if options.diagnose and n > 0:
        signatures = signature_numbers(host)
        calibration = calibration if calibration is not None else Calibration()
        diagnosis = Diagnosis.impossible_inputs(problems.values()) if problems else likely_cause(
            signatures, n_tokens=n, noise_floor=calibration.noise_floor, evidence=evidence, facts=facts,
            by_lag=host.by_lag, trend=calibration.recent_gaps, sampling_trend=calibration.recent_sampling_z,
            max_policy_lag=options.max_policy_lag, by_server=by_server,
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
        exceeds=guard_rail.exceeds(scalars, host, prefix=options.prefix, facts=facts),
        untrusted=guard_rail.untrusted(scalars, host, facts),
    )


def refuse_mask(host: HostDivergence) -> None:
    """A ``ValueError`` when the step's mask held negative or NaN values where it was not read per micro-batch (an
    accelerator: ``batch``), naming how many and the first, as any mask read on the CPU is refused."""
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


def deliver(loggers: Iterable[Any], report: StepReport, *, step: int, prefix: str,
            warnings: RunWarnings | None = None) -> None:
    """Log ``report`` at ``step`` to each logger (module docstring), every key under ``prefix``."""
    from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger  # the callback's: Lightning is loaded

    scalars = {prefix + name: value for name, value in {**report.scalars, **report.breakdown}.items()}
    texts = {key: worst_tokens_markdown(rows) if key == TABLE_KEY else markdown(columns, rows)
             for key, (columns, rows) in report.tables.items()}
    if report.diagnosis is not None:
        texts[DIAGNOSIS_KEY] = report.diagnosis.message
    for logger in loggers:
        try:
            if isinstance(logger, WandbLogger):
                logger.log_metrics({**scalars, **wandb_media(report, prefix)}, step=step)
                continue
            logger.log_metrics(scalars, step=step)
            if isinstance(logger, TensorBoardLogger):
                if report.histogram is not None:
                    logger.experiment.add_histogram(prefix + HISTOGRAM_KEY, report.histogram, step)
                for key, text in texts.items():
                    logger.experiment.add_text(prefix + key, text, step)
        except Exception as error:  # a full disk, a closed W&B run, a network error
            name = type(logger).__name__
            (warnings or RunWarnings()).warn(
                f"logger:{name}", f"KLSampleTrainMonitor could not log to {name} at step {step}: {error!r}; training "
                "goes on")


def deliver_text(loggers: Iterable[Any], key: str, text: str, *, step: int, warnings: RunWarnings | None = None,
                 preformatted: bool = False) -> None:
    """Write ``text`` under ``key`` at ``step`` to each logger that can show text; others (CSV) are skipped.

    ``TensorBoardLogger``: ``add_text`` (Markdown; ``preformatted`` text is indented into a code block, so
    its lines stay as they are); ``WandbLogger``: a ``wandb.Html`` panel holding it as preformatted HTML.
    A failing logger is a warning, never an error.

    Examples:
        >>> deliver_text([object()], "div/stop", "stopped", step=3)  # a logger without text: nothing
    """
    from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger  # the callback's: Lightning is loaded

    for logger in loggers:
        try:
            if isinstance(logger, TensorBoardLogger):
                shown = "\n".join("    " + line for line in text.splitlines()) if preformatted else text
                logger.experiment.add_text(key, shown, step)
            elif isinstance(logger, WandbLogger):
                logger.log_metrics({key: html_panel(text)}, step=step)
        except Exception as error:  # a full disk, a closed W&B run
            name = type(logger).__name__
            (warnings or RunWarnings()).warn(
                f"text:{name}", f"KLSampleTrainMonitor could not log {key!r} to {name} at step {step}: {error!r}")


def markdown(columns: Iterable[str], rows: list[list[Any]]) -> str:
    """A Markdown table (TensorBoard's text panel renders it); numbers to 6 significant digits.

    Examples:
        >>> print(markdown(["stratum", "k3", "is_ratio_mean"], [["pos_q1", 0.05, 1.0]]))
        | stratum | k3 | is_ratio_mean |
        |---|---|---|
        | pos_q1 | 0.05 | 1 |
    """
    columns = list(columns)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(c if isinstance(c, str) else f"{c:.6g}" for c in row) + " |" for row in rows]
    return "\n".join(lines)


def worst_tokens_markdown(rows: list[list[Any]]) -> str:
    """The worst-tokens table as Markdown; token and context as code.

    Examples:
        >>> print(worst_tokens_markdown([[1, 0, 2, "9", -0.5, -2.5, -2.0, 0.1353, "a|b"]]))
        | rank | datum | position | token | logp_sampler | logp_trainer | diff | is_weight | context |
        |---|---|---|---|---|---|---|---|---|
        | 1 | 0 | 2 | `9` | -0.5 | -2.5 | -2.0 | 0.1353 | `a\\|b` |
    """
    token = WORST_TOKEN_COLUMNS.index("token")
    cells = [[_code(escape(str(value))) if i == token else str(value) for i, value in enumerate(numbers)]
             + [_code(str(context))] for *numbers, context in rows]  # the context is already escaped
    return markdown(WORST_TOKEN_COLUMNS, cells)


def _code(text: str) -> str:
    """A Markdown code span that survives a table cell: ``|`` escaped, a longer fence around backticks."""
    text = text.replace("|", "\\|")
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def decode_record(record: np.ndarray) -> dict[str, Any] | None:
    """The first differing datum's index, position, lengths and context ids from a host ``prompt_first``
    (``None``: no datum differs).

    Examples:
        >>> values = np.array([0, 2, 4, 3] + [-1, -1, 5, 6, 7, 8, 9, -1] + [-1, -1, 5, 6, 8, -1, -1, -1], dtype=float)
        >>> found = decode_record(values + 1 - 3 * PROMPT_SCALE)
        >>> found["datum"], found["position"], found["sampler_before"], found["sampler"], found["trainer"]
        (3, 2, [5, 6], [7, 8, 9], [8])
    """
    record = np.asarray(record, dtype=np.float64)
    if record.size != PROMPT_RECORD or not np.isfinite(record[0]):
        return None
    datum = int(-math.floor(record[0] / PROMPT_SCALE))
    values = (record + datum * PROMPT_SCALE - 1).round().astype(np.int64)
    half = PROMPT_CONTEXT // 2
    sampler, trainer = (values[len(RECORD) + i * PROMPT_CONTEXT: len(RECORD) + (i + 1) * PROMPT_CONTEXT]
                        for i in range(2))
    return {"datum": datum, "position": int(values[1]), "sampler_length": int(values[2]),
            "trainer_length": int(values[3]), "sampler": [int(v) for v in sampler[half:] if v >= 0],
            "sampler_before": [int(v) for v in sampler[:half] if v >= 0],
            "trainer": [int(v) for v in trainer[half:] if v >= 0],
            "trainer_before": [int(v) for v in trainer[:half] if v >= 0]}


def prompt_finding(totals: Mapping[str, float], arrays: Mapping[str, np.ndarray],
                   decode: Callable[[list[int]], str] = lambda ids: " ".join(map(str, ids))
                   ) -> tuple[str, dict[str, float]] | None:
    """What the run says of its prompts when some datum's differ: the sentence (ids shown by ``decode``) and its
    numbers; ``None`` when none differs or none was compared.

    Examples:
        >>> values = np.array([0, 1, 2, 2] + [-1, -1, -1, 5, 6, -1, -1, -1] + [-1, -1, -1, 5, 7, -1, -1, -1], dtype=float)
        >>> print(prompt_finding({"n_prompt_datums_differ": 1.0, "n_prompt_datums_compared": 2.0},
        ...                      {"prompt_first": values + 1})[0])
        in 1 of 2 compared datums; datum 0 at prompt token 1 (the prompts agree after it): sampler '…5⟦6…' vs trainer '…5⟦7…'
    """
    differ = totals.get("n_prompt_datums_differ", 0.0)
    record = arrays.get("prompt_first")
    found = decode_record(record) if differ and record is not None else None
    if found is None:
        return None
    compared = totals.get("n_prompt_datums_compared", 0.0)

    def text(before: list[int], after: list[int]) -> str:
        return f"'…{decode(before) if before else ''}⟦{decode(after) if after else '<end>'}…'"

    lengths = ""
    if found["sampler_length"] != found["trainer_length"]:
        lengths = (f" (the sampler's prompt has {found['sampler_length']} tokens, the trainer's "
                   f"{found['trainer_length']})")
    where = f"at prompt token {found['position']} (the prompts agree after it)"
    if found["trainer_length"] > found["sampler_length"] and found["sampler"][:1] == found["trainer"][:1]:
        where = (f"before the sampler's first prompt token (the prompts agree from it on: the trainer's has "
                 f"{found['trainer_length'] - found['sampler_length']} more before it)")
    said = (f"in {differ:.0f} of {compared:.0f} compared datums; datum {found['datum']} {where}{lengths}: sampler {text(found['sampler_before'], found['sampler'])} vs trainer "
            f"{text(found['trainer_before'], found['trainer'])}")
    numbers = {"prompt_datums_differ": float(differ), "prompt_datums_compared": float(compared),
               "prompt_datum": float(found["datum"]), "prompt_position": float(found["position"])}
    return said, numbers


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
    together); ``None`` when there are none. ``label`` names the advantages key (``batch.key_label``).

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
