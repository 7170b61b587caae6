"""``DivergenceStats``: a batch's statistics on its device, merged across micro-batches; ``HostDivergence``,
their one host copy.

Every sum and maximum is declared in ``states`` (its formula in ``sums`` or ``shadow``) and merges by its
reduction; three parts merge their own way: the ``top_n`` worst rows (ranked by |d|, datums
renumbered), a sample of the per-token diffs d = trainer logprob - sampler logprob (bottom-k of one
random key per token: a uniform sample without replacement of the union, exact percentiles while
it holds at most ``sample_size`` diffs; all of them without one), and the groups' table. Merged
statistics equal those of the concatenated batch (sums up to summation order; counts, maxima,
rows exactly). ``reduction`` reduces them across ranks.

Examples:
    >>> from loops_callbacks.divergence.flat_batch import flatten_padded
    >>> flat = flatten_padded(sampler_logprobs=torch.tensor([[-1.0, -2.0]]),
    ...                       training_logprobs=torch.tensor([[-1.5, -2.0]]), mask=torch.ones(1, 2))
    >>> host = DivergenceStats.from_batch(flat).to_host()
    >>> host.totals["n_action_tokens"], host.totals["sum_d"], host.diffs.tolist()
    (2.0, -0.5, [-0.5, 0.0])
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from loops_callbacks.correction import Correction
from loops_callbacks.divergence import sums as formulas
from loops_callbacks.divergence.flat_batch import FlatBatch
from loops_callbacks.divergence.shadow import parse_corrections, shadow_statistics, shadow_values
from loops_callbacks.divergence.states import (
    GROUP_ROWS, LAG_LABELS, LAG_STRATA, MAIN, ROW, SIGNATURES, STRATA, STRATUM_NAMES, Layout, by_group, ranked_rows,
)
from loops_callbacks.validation import check_int

CHUNK_POSITIONS = 1 << 18
"""On the CPU, ``from_batch`` reads at most about this many positions at a time (whole datums)."""


@functools.lru_cache(maxsize=64)
def layout_of(diagnose: bool = True, max_groups: int | None = None, corrections: tuple[Correction, ...] = ()
              ) -> Layout:
    """The states a monitor with these options keeps: every step's, the diagnosis' sums when ``diagnose``,
    the strata with ``max_groups``, the shadow statistics of ``corrections``; made once per set of options."""
    check_int("max_groups", max_groups, least=1, optional=True)
    states = MAIN + (SIGNATURES if diagnose else ()) + (STRATA if max_groups is not None else ())
    return Layout(states + shadow_statistics(corrections), max_groups, corrections)


@dataclass(frozen=True)
class DivergenceStats:
    """Statistics of one or more batches on their device (module docstring); ``reduction`` reduces them."""

    sums: torch.Tensor  # float64 [layout.sizes["sum"]]
    maxima: torch.Tensor  # float64 [layout.sizes["max"]]; -inf when empty
    worst: torch.Tensor  # float64 [top_n, ROW.WIDTH], most divergent first; rows with ABS = -inf are empty
    sample: torch.Tensor  # float64 [m] diffs, in batch order
    sample_keys: torch.Tensor | None  # float64 [m]; +inf marks an empty slot; None: every diff kept
    layout: Layout
    sample_size: int | None = None
    groups: torch.Tensor | None = None  # float64 [GROUP_ROWS, K], the groups seen; None: no group key

    @classmethod
    @torch.no_grad()
    def from_batch(
        cls,
        flat: FlatBatch,
        *,
        top_n: int = 0,
        sample_size: int | None = None,
        generator: torch.Generator | None = None,
        diagnose: bool = True,
        max_groups: int | None = None,
        corrections: Sequence[str | Correction] = (),
        rank: int = 0,
    ) -> DivergenceStats:
        """Read one flattened batch: ``top_n`` worst rows (with token ids when ``flat.tokens`` is set), a
        sample of at most ``sample_size`` diffs (``generator`` draws their keys), and the states ``layout_of``
        declares (``diagnose=False``: none of the diagnosis' sums, as the plain SDK functions need none;
        ``max_groups``: the strata, lags and groups from ``flat``; ``corrections``: their shadow statistics,
        with this process's ``rank`` where advantages could not be read). On the CPU a batch of more than
        ``CHUNK_POSITIONS`` positions is read in whole-datum chunks, so its temporaries stay small."""
        check_int("top_n", top_n, least=0)
        check_int("sample_size", sample_size, least=1, optional=True)
        layout = layout_of(diagnose, max_groups, parse_corrections(corrections))
        chunks = flat.datum_chunks(CHUNK_POSITIONS) if flat.device.type == "cpu" else [flat]
        parts = []
        for chunk in chunks:
            values, worst, sample, sample_keys, groups = formulas.of_chunk(chunk, layout, top_n, sample_size, generator)
            if layout.corrections:
                values.update(shadow_values(chunk, layout.corrections, chunk.datum_advantages, rank=rank))
            # each chunk keeps its sample_size smallest keys at once: the merged sample is the same, and a
            # large batch never holds every position's diff and key until the end
            parts.append(cls(*layout.pack(values), worst, sample, sample_keys, layout, sample_size, groups).capped())
        return cls.concatenated(parts)

    def merge(self, later: DivergenceStats) -> DivergenceStats:
        """Statistics of this batch followed by ``later`` (datum indices of ``later`` shift)."""
        return DivergenceStats.concatenated([self, later])

    @staticmethod
    def concatenated(parts: Sequence[DivergenceStats]) -> DivergenceStats:
        """Statistics of ``parts`` in order, as ``merge`` one after the other gives them."""
        if len(parts) == 1:
            return parts[0].capped()  # one chunk's diffs beyond sample_size are cut as merged ones are
        first = parts[0]
        n_datums = first.layout.index("n_datums")
        worst, maxima, datums = [], [], 0.0
        for part in parts:
            worst.append(part.worst.clone())
            worst[-1][:, ROW.DATUM] += datums
            maxima.append(part.layout.renumbered(part.maxima, datums))
            datums = datums + part.sums[n_datums]
        sample_keys = None
        if any(part.sample_keys is not None for part in parts):
            sample_keys = torch.cat([part.sample_keys if part.sample_keys is not None else torch.zeros_like(part.sample)
                                     for part in parts])
        groups = [part.groups for part in parts if part.groups is not None]
        return dataclasses.replace(
            first,
            sums=functools.reduce(torch.add, [part.sums for part in parts]),
            maxima=functools.reduce(torch.maximum, maxima),
            worst=ranked_rows(torch.cat(worst), max(part.worst.shape[0] for part in parts)),
            sample=torch.cat([part.sample for part in parts]),
            sample_keys=sample_keys,
            groups=formulas.merged_groups(torch.cat(groups, dim=1)) if groups else None,
        ).capped()

    def capped(self) -> DivergenceStats:
        """The ``sample_size`` diffs of smallest key, in batch order (itself when uncapped or small)."""
        if self.sample_size is None or self.sample_keys is None or self.sample_keys.shape[0] <= self.sample_size:
            return self
        keep = torch.topk(self.sample_keys, self.sample_size, largest=False, sorted=False).indices.sort().values
        return dataclasses.replace(self, sample=self.sample.index_select(0, keep),
                                   sample_keys=self.sample_keys.index_select(0, keep))

    def to_host(self) -> HostDivergence:
        """Everything on the host, in one device-to-host transfer."""
        sample_keys = self.sample_keys if self.sample_keys is not None else self.sample.new_zeros(0)
        groups = self.groups if self.groups is not None else self.sample.new_zeros(GROUP_ROWS, 0)
        parts = [self.sums, self.maxima, self.worst.reshape(-1), self.sample, sample_keys, groups.reshape(-1)]
        host = torch.cat(parts).cpu().numpy()
        sums, maxima, worst, sample, keys_, groups_ = np.split(host, np.cumsum([part.numel() for part in parts])[:-1])
        totals, arrays = self.layout.read(sums, "sum")
        extrema, max_arrays = self.layout.read(maxima, "max")
        arrays |= max_arrays
        worst = worst.reshape(-1, ROW.WIDTH)
        strata = None
        if self.layout.max_groups is not None:
            strata = {name: StratumSums(*map(float, arrays["strata"][:, i])) for i, name in enumerate(STRATUM_NAMES)}
            table = by_group(torch.from_numpy(groups_.reshape(GROUP_ROWS, -1))).numpy()
            for index, *column in table[:, table[1] > 0].T.tolist():  # the groups with tokens, in index order
                strata["group_other" if index >= self.layout.max_groups else f"group_{int(index)}"] = StratumSums(*column)
        return HostDivergence(
            totals, extrema, worst[worst[:, ROW.ABS] > -math.inf],
            sample[keys_ < math.inf] if self.sample_keys is not None else sample, arrays, strata,
        )


@dataclass(frozen=True)
class StratumSums:
    """One stratum's sums on the host (``COLUMNS``), and the three numbers they give (NaN without tokens).

    Examples:
        >>> stratum = StratumSums(n_tokens=4.0, sum_k3=0.2, sum_abs_d=2.0, sum_is_ratio=4.4)
        >>> stratum.k3, stratum.abs_d_mean, stratum.is_ratio_mean
        (0.05, 0.5, 1.1)
    """

    n_tokens: float
    sum_k3: float
    sum_abs_d: float
    sum_is_ratio: float

    @property
    def k3(self) -> float:
        return self.sum_k3 / self.n_tokens if self.n_tokens else math.nan

    @property
    def abs_d_mean(self) -> float:
        return self.sum_abs_d / self.n_tokens if self.n_tokens else math.nan

    @property
    def is_ratio_mean(self) -> float:
        return self.sum_is_ratio / self.n_tokens if self.n_tokens else math.nan


@dataclass(frozen=True)
class HostDivergence:
    """Statistics on the host: the numbers by name (sums in ``totals``, maxima in ``extrema``), the worst
    rows, the kept diffs in order, the non-scalar sums by name (``arrays``) and the strata by name."""

    totals: dict[str, float]
    extrema: dict[str, float]
    worst: np.ndarray = field(default_factory=lambda: np.zeros((0, ROW.WIDTH)))  # most divergent first
    diffs: np.ndarray = field(default_factory=lambda: np.zeros(0))  # float64, the sampled diffs in batch order
    arrays: dict[str, np.ndarray] = field(default_factory=dict)  # token_sums, offset_sums, strata, prompt_first
    strata: dict[str, StratumSums] | None = None

    @property
    def token_sums(self) -> np.ndarray | None:
        return self.arrays.get("token_sums")

    @property
    def offset_sums(self) -> np.ndarray | None:
        return self.arrays.get("offset_sums")

    @property
    def by_lag(self) -> dict[str, StratumSums]:
        """The lag strata by ``LAG_LABELS`` (``"0"`` … ``"8+"``, all six in order) when some token had a
        policy version, else ``{}``: stale weights show as k3 growing with the lag."""
        lags = {label: self.strata[name] for label, name in zip(LAG_LABELS, LAG_STRATA)} if self.strata else {}
        return lags if any(stratum.n_tokens for stratum in lags.values()) else {}
