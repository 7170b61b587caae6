"""Which rollout correction, with which bounds: ``Correction`` and ``parse_correction``.

Every method is named as the framework it comes from names it, with that framework's defaults:

===================  =========================  ===============================================================
method               parameters (default)       from
===================  =========================  ===============================================================
token_truncate       clip_min (None),           TRL 1.16 GRPO ``vllm_importance_sampling_mode`` (its default
token_mask           clip_max (3.0)             mode is ``sequence_mask``), ``vllm_importance_sampling_clip_min``
sequence_truncate                               / ``_clip_max``: truncate clamps the ratio into [min, max],
sequence_mask                                   mask zeroes it outside; sequence modes use the product of the
                                                sequence's token ratios
icepop               clip_min (0.5),            IcePop (Ring-1T / Ling team): the two-sided token mask, the
                     clip_max (5.0)             formula of ``token_mask``, with the report's α = 0.5, β = 5 (no
                                                golden: no peer's code of it was at hand)
token_tis            threshold (2.0)            verl ``rollout_is="token"`` / ``"sequence"``,
sequence_tis                                    ``rollout_is_threshold``: truncated IS, log ratio clamped to
                                                ±20 before ``exp``
token_k1             lower (1/upper), upper     verl ``rollout_rs`` with ``rollout_rs_threshold``: rejection
seq_sum_k1 ...       (required)                 where a token's (or a sequence's sum / mean / max of) k1 / k2 /
token_k2, token_k3   upper (required)           k3 leaves its bounds; k1 = log(p_sampler / p_trainer) kept in
seq_sum_k2 ...                                  [log lower, log upper], k2 and k3 kept <= upper
geo                  lower (0.999),             verl's geometric-mean rejection (``seq_mean_k1``, its presets'
                     upper (1.001)              ``0.999_1.001``; DeepSeek-V3.2); ``geo:x`` is [1/x, x], as verl
                                                reads one ``seq_mean_k1`` threshold
off_policy_mask      threshold (required)       TRL ``off_policy_mask_threshold`` (DeepSeek-V3.2's δ): drop a
                                                sequence with a negative advantage whose mean sampler-minus-
                                                trainer KL exceeds δ
===================  =========================  ===============================================================

A spec is a ``Correction`` or a string: ``"sequence_mask"`` (all defaults), ``"sequence_mask:3.0"``
(the upper bound), ``"token_mask:0.5_2.0"`` (lower and upper, verl's ``lower_upper`` syntax),
``"token_truncate(clip_max=2.0, clip_min=None)"`` (by name).

Examples:
    >>> parse_correction("token_truncate(clip_max=2.0)").name
    'token_truncate(clip_max=2.0)'
    >>> parse_correction("seq_mean_k1:0.999_1.001") == Correction("seq_mean_k1", {"lower": 0.999, "upper": 1.001})
    True
    >>> dict(parse_correction("token_k1:2.0").params)
    {'lower': 0.5, 'upper': 2.0}
    >>> dict(parse_correction("geo:1.25").params)
    {'lower': 0.8, 'upper': 1.25}
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

import torch

from loops_callbacks.validation import check, check_choice, check_real


FLOAT32_MAX = float(torch.finfo(torch.float32).max)
"""The largest bound (in magnitude) a correction takes."""
REQUIRED = object()
"""A parameter's default that marks it as required."""


@dataclass(frozen=True)
class Method:
    """A correction method: its parameters (lower bound first), their defaults, and where it comes from."""

    name: str
    family: Literal["trl", "verl_is", "verl_rs", "off_policy"]
    formula: str  # the peer's own name of the formula: a TRL mode, a verl rollout_rs option, token / sequence
    defaults: Mapping[str, object]  # parameter -> default (None: no bound; REQUIRED: must be given)
    source: str

    @property
    def level(self) -> Literal["token", "sequence"]:
        """Whether each token has its own weight, or each sequence one (read from the formula's name)."""
        return "token" if self.formula.startswith("token") else "sequence"

    @property
    def needs_advantages(self) -> bool:
        return self.family == "off_policy"

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(self.defaults)


def _trl(mode: str, name: str = "", clip_min: float | None = None, clip_max: float = 3.0,
         source: str = "TRL 1.16 GRPOConfig.vllm_importance_sampling_mode") -> Method:
    return Method(name or mode, "trl", mode, {"clip_min": clip_min, "clip_max": clip_max}, source)


def _verl_rs(option: str, name: str = "", lower: object = REQUIRED, upper: object = REQUIRED,
             source: str = "") -> Method:
    defaults = {"lower": lower, "upper": upper} if option.endswith("k1") else {"upper": upper}
    source = source or f"verl rollout_rs={option!r} (rollout_corr_helper.compute_rollout_rejection_mask)"
    return Method(name or option, "verl_rs", option, defaults, source)


METHODS: Mapping[str, Method] = MappingProxyType({
    m.name: m
    for m in (
        _trl("token_truncate"),
        _trl("token_mask"),
        _trl("sequence_truncate"),
        _trl("sequence_mask"),
        _trl("token_mask", "icepop", 0.5, 5.0,
             source="IcePop (Ring-1T report, alpha 0.5, beta 5): the token_mask formula"),
        Method("token_tis", "verl_is", "token", {"threshold": 2.0}, "verl rollout_is='token', rollout_is_threshold"),
        Method("sequence_tis", "verl_is", "sequence", {"threshold": 2.0},
               "verl rollout_is='sequence', rollout_is_threshold"),
        *(_verl_rs(f"{level}_{k}") for level in ("token", "seq_sum", "seq_mean") for k in ("k1", "k2", "k3")),
        _verl_rs("seq_max_k2"),
        _verl_rs("seq_max_k3"),
        _verl_rs("seq_mean_k1", "geo", 0.999, 1.001, source="verl decoupled_geo_rs preset: seq_mean_k1 at 0.999_1.001"),
        Method("off_policy_mask", "off_policy", "off_policy_mask", {"threshold": REQUIRED},
               "TRL 1.16 GRPOConfig.off_policy_mask_threshold (DeepSeek-V3.2 off-policy sequence masking)"),
    )
})
"""Every method by name (module docstring)."""


@dataclass(frozen=True)
class Correction:
    """One correction: a method of ``METHODS`` and its parameters, every default filled in.

    ``params`` may leave out parameters that have defaults; the stored ``params`` is complete and
    read-only. Bad methods, names or values are a ``ValueError`` naming them.

    Examples:
        >>> Correction("sequence_mask").params["clip_max"]
        3.0
    """

    method: str
    params: Mapping[str, float | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        spec = METHODS[check_choice("Correction.method", self.method, sorted(METHODS))]
        check("Correction.params", self.params, Mapping, "a mapping")
        unknown = sorted(set(self.params) - set(spec.params))
        if unknown:
            raise ValueError(f"correction {self.method!r} has no parameter {unknown}; its parameters: {list(spec.params)}")
        filled: dict[str, float | None] = {}
        for name, default in spec.defaults.items():
            value = self.params.get(name, default)
            if name == "lower" and name not in self.params and (value is REQUIRED or "upper" in self.params):
                continue  # verl reads one k1 threshold as the upper bound and 1 / upper (geo's preset too)
            if value is REQUIRED:
                raise ValueError(f"correction {self.method!r} needs {name!r} (no default; {spec.source}); "
                                 f"e.g. '{self.method}({name}=...)' or '{self.method}:<value>'")
            if value is None and spec.family != "trl":
                raise ValueError(f"correction {self.method!r}: {name!r} must be a number (only TRL's clips can be None)")
            filled[name] = None if value is None else _number(self.method, name, value)
        _check_bounds(spec, filled)
        if "lower" in spec.defaults and "lower" not in filled:
            filled = {"lower": 1.0 / filled["upper"], **filled}  # type: ignore[operator]  # upper > 0: checked
            _check_bounds(spec, filled)  # an upper bound below 1 leaves nothing between 1 / upper and upper
        object.__setattr__(self, "params", MappingProxyType(filled))

    def __hash__(self) -> int:
        return hash((self.method, tuple(self.params.items())))

    def __reduce__(self) -> tuple[type[Correction], tuple[str, dict[str, float | None]]]:
        """Pickled as its method and a plain dict (a read-only mapping cannot be; ``ddp_spawn`` pickles callbacks)."""
        return Correction, (self.method, dict(self.params))

    def __repr__(self) -> str:
        return f"Correction({self.method!r}, {dict(self.params)!r})"

    @property
    def spec(self) -> Method:
        return METHODS[self.method]

    @property
    def name(self) -> str:
        """The method, then the parameters that differ from their defaults: a stable log name.

        Examples:
            >>> Correction("token_mask", {"clip_min": 0.5}).name
            'token_mask(clip_min=0.5)'
        """
        changed = [f"{k}={v}" for k, v in self.params.items() if self.spec.defaults[k] != v]
        return f"{self.method}({', '.join(changed)})" if changed else self.method


def _number(method: str, name: str, value: object) -> float:
    """``value`` as a float within float32's range: weights are float32 at least, so no bound can overflow them."""
    return check_real(f"correction {method!r}: {name!r}", value, least=-FLOAT32_MAX, most=FLOAT32_MAX,
                      what=f"a finite number (|x| <= {FLOAT32_MAX:.2g}, float32's range) or None")


def _check_bounds(spec: Method, params: Mapping[str, float | None]) -> None:
    for name, value in params.items():
        if value is None or spec.family == "off_policy":  # δ bounds a mean KL estimate, which may be negative
            continue
        if value < 0 or (value == 0 and name != "clip_min"):
            raise ValueError(f"correction {spec.name!r}: {name!r} must be positive, got {value}")
    low = params.get("clip_min", params.get("lower"))
    high = params.get("clip_max", params.get("upper"))
    if low is not None and high is not None and low > high:
        raise ValueError(f"correction {spec.name!r}: lower bound {low} is above the upper bound {high}")


_CALL = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:\((.*)\)|:(.*))?\s*$", re.DOTALL)


def parse_correction(spec: str | Correction) -> Correction:
    """A ``Correction`` from a spec string (module docstring) or a ``Correction`` (returned as is).

    ``"method:x"`` sets the upper bound (the only parameter of one-parameter methods); ``"method:a_b"``
    the lower and the upper bound.

    Examples:
        >>> parse_correction("sequence_mask:2.5").params["clip_max"]
        2.5
        >>> parse_correction("token_mask(clip_min=0.5, clip_max=None)").name
        'token_mask(clip_min=0.5, clip_max=None)'
    """
    if isinstance(spec, Correction):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"a correction is a str like 'sequence_mask:3.0' or a Correction, got {type(spec).__name__}")
    match = _CALL.match(spec)
    if match is None:
        raise ValueError(f"cannot read correction {spec!r}; write 'method', 'method:value', 'method:low_high' or "
                         "'method(name=value, ...)'")
    method, keywords, shorthand = match.groups()
    if method not in METHODS:
        raise ValueError(f"correction {spec!r}: unknown method {method!r}; known: {sorted(METHODS)}")
    params: dict[str, float | None] = {}
    if keywords is not None and keywords.strip():
        for item in keywords.split(","):
            name, sep, value = (part.strip() for part in item.partition("="))
            if not sep:
                raise ValueError(f"correction {spec!r}: {item.strip()!r} is not name=value")
            if name in params:
                raise ValueError(f"correction {spec!r}: {name!r} is given twice")
            params[name] = _literal(spec, value)
    elif shorthand is not None:
        names = METHODS[method].params
        values = [_literal(spec, part) for part in shorthand.split("_")]
        if len(values) > len(names):
            raise ValueError(f"correction {spec!r}: {method!r} takes {' or '.join(names)}; got {len(values)} values")
        params = dict(zip(names[-len(values):], values))  # the upper bound, or the lower and the upper bound
    return Correction(method, params)


def _literal(spec: str, text: str) -> float | None:
    text = text.strip()
    if text.lower() in ("none", "null"):
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"correction {spec!r}: {text!r} is not a number or None") from None
