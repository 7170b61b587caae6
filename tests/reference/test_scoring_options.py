"""One scoring run's options travel as one object: ``score_across_ranks`` gathers its keywords into one
``ScoringOptions`` and hands it whole to ``score_packed_across_ranks``; the reference mixin makes it once from its
``ReferenceConfig`` and hands it down whole; ``TorchSamplingClient.snapshot`` and ``resolve_reference`` hand a
client one ``TorchClientSettings``."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest
import torch

import loops_callbacks.data.reference_mixin as reference_mixin
import loops_callbacks.reference.across_ranks as across_ranks
from loops_callbacks.data import ReferenceLogprobsMixin, dpo_pair_datums
from loops_callbacks.data.labels import datum_label
from loops_callbacks.reference import ScoringOptions, TorchSamplingClient, resolve_reference
from loops_callbacks.reference.cache import CACHE_FILE_NAME
from loops_callbacks.reference.clients import TorchClientSettings
from loops_callbacks.reference.config import ReferenceConfig
from loops_callbacks.types import Datum, ModelInput

SEQUENCES = [[1, 2, 3], [1, 4], [5, 6, 7, 8], [5, 9]]


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))


def record_packed_scoring(monkeypatch: pytest.MonkeyPatch, module: Any) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """The arguments of each call ``module`` makes to ``score_packed_across_ranks`` (which still runs)."""
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    packed_scorer = module.score_packed_across_ranks

    def recording(*args: Any, **kwargs: Any) -> Any:
        calls.append((args, kwargs))
        return packed_scorer(*args, **kwargs)

    monkeypatch.setattr(module, "score_packed_across_ranks", recording)
    return calls


def test_score_across_ranks_keywords_are_the_options_fields_with_their_defaults() -> None:
    keywords = {
        name: parameter.default
        for name, parameter in inspect.signature(across_ranks.score_across_ranks).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    }
    fields = {field.name: field.default for field in dataclasses.fields(ScoringOptions)}
    assert keywords == fields


def test_score_across_ranks_hands_one_options_object_to_the_packed_scorer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = record_packed_scoring(monkeypatch, across_ranks)
    data = [Datum(ModelInput.from_ints(s)) for s in SEQUENCES]
    path = tmp_path / CACHE_FILE_NAME
    _, report = across_ranks.score_across_ranks(
        data, TorchSamplingClient(tiny_model()), SEQUENCES, cache_path=path, cache_tag="bfloat16", progress=False,
        shard_unit=2, scoring_timeout=30.0, datum_name=datum_label,
    )
    [(args, kwargs)] = calls
    assert args[2] == ScoringOptions(
        cache_path=str(path), cache_tag="bfloat16", progress=False, shard_unit=2, scoring_timeout=30.0,
        datum_name=datum_label,
    )
    assert set(kwargs) == {"datums"}
    assert report.cache_key is not None and report.cache_key.dtype == "bfloat16" and report.cache_written


class _Base:
    """What ``LightningDataModule.setup`` is to the mixin (nothing)."""

    def setup(self, stage: str) -> None:
        pass


class Pairs(ReferenceLogprobsMixin, _Base):
    """The mixin over two pairs of datums, set up by hand (no trainer)."""

    def __init__(self, reference: Any, cache_dir: Path) -> None:
        super().__init__()
        self.configure_reference(
            reference, cache_dir=cache_dir, scoring_dtype="float32", progress=False, scoring_timeout=45.0,
            reference_fingerprint="my-reference",
        )

    def dpo_data(self) -> list[Any]:
        return [*dpo_pair_datums([1, 2, 3], [1, 4], 1), *dpo_pair_datums([5, 6, 7, 8], [5, 9], 1)]


def test_the_mixin_makes_the_options_once_from_its_config_and_hands_them_down_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = record_packed_scoring(monkeypatch, reference_mixin)
    module = Pairs(tiny_model(), tmp_path)
    module.setup("fit")
    [(args, kwargs)] = calls
    assert args[2] == ScoringOptions(
        cache_path=str(tmp_path / CACHE_FILE_NAME), reference_fingerprint="my-reference", cache_tag="float32",
        progress=False, shard_unit=2, scoring_timeout=45.0, datum_name=datum_label,
    )
    assert set(kwargs) <= {"datums"}
    assert module.reference_report is not None and module.reference_report.cache_key.dtype == "float32"


def test_snapshot_hands_the_client_one_settings_object_checked_before_the_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    given: list[TorchClientSettings] = []
    set_up = TorchSamplingClient._set_up

    def recording(self: TorchSamplingClient, model: Any, settings: TorchClientSettings) -> None:
        given.append(settings)
        set_up(self, model, settings)

    monkeypatch.setattr(TorchSamplingClient, "_set_up", recording)
    client = TorchSamplingClient.snapshot(tiny_model(), dtype="float64", device="cpu", max_tokens_per_batch=64)
    assert given == [TorchClientSettings(device=torch.device("cpu"), dtype=torch.float64, max_tokens_per_batch=64)]
    assert client.settings is given[0] and client.dtype == torch.float64 and client.max_tokens_per_batch == 64

    copies: list[Any] = []
    monkeypatch.setattr("copy.deepcopy", lambda module: copies.append(module))
    with pytest.raises(ValueError, match="max_tokens_per_batch must be an int >= 1, got 0"):
        TorchSamplingClient.snapshot(tiny_model(), max_tokens_per_batch=0)
    assert copies == []  # refused before any copy of the weights


def test_resolve_reference_gives_a_local_reference_the_configs_settings() -> None:
    config = ReferenceConfig(scoring_dtype="bfloat16", max_tokens_per_batch=96)
    expected = TorchClientSettings(device=torch.device("cpu"), dtype=torch.bfloat16, max_tokens_per_batch=96)
    module = tiny_model()
    client = resolve_reference(module, config=config, device="cpu")
    assert client.settings == expected and client.model is not module and not client.model.training
    assert next(module.parameters()).dtype == torch.float32  # the module itself is not cast
    plain = resolve_reference(lambda ids: torch.zeros(*ids.shape, 4), config=ReferenceConfig(max_tokens_per_batch=96))
    assert plain.settings == TorchClientSettings(max_tokens_per_batch=96)
    with pytest.raises(ValueError, match="dtype='bfloat16' cannot cast a plain callable reference"):
        resolve_reference(lambda ids: torch.zeros(*ids.shape, 4), config=config)


@pytest.mark.parametrize(
    ("field", "value", "error", "message"),
    [
        ("shard_unit", 0, ValueError, "shard_unit must be an int >= 1, got 0"),
        ("shard_unit", 2.0, TypeError, "shard_unit must be an int >= 1, got 2.0"),
        ("shard_unit", True, TypeError, "shard_unit must be an int >= 1, got True"),
        ("progress", 1, TypeError, "progress must be a bool, got 1"),
        ("progress", "no", TypeError, "progress must be a bool, got 'no'"),
        ("cache_path", 3, TypeError, "cache_path must be a path or None, got 3"),
        ("reference_fingerprint", b"ab", TypeError, "reference_fingerprint must be a string or None, got b'ab'"),
        ("cached_only", True, TypeError, "cached_only must be a string or None, got True"),
        ("cache_tag", None, TypeError, "cache_tag must be a non-empty string, got None"),
        ("cache_tag", "", ValueError, "cache_tag must be a non-empty string, got ''"),
        ("scoring_timeout", 0, ValueError, "scoring_timeout=0 must be more than 0 seconds"),
        ("scoring_timeout", float("nan"), ValueError, "scoring_timeout=nan must be more than 0 seconds"),
        ("scoring_timeout", "30", TypeError, "scoring_timeout='30' must be a number of seconds"),
        ("datum_name", "pair", TypeError, "datum_name must be a callable .datum index -> name. or None, got 'pair'"),
    ],
)
def test_scoring_options_refuse_a_bad_field_naming_it_and_the_value(
    field: str, value: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        ScoringOptions(**{field: value})


def test_a_bad_shard_unit_is_refused_before_any_scoring() -> None:
    data = [Datum(ModelInput.from_ints(s)) for s in SEQUENCES]
    with pytest.raises(ValueError, match="shard_unit must be an int >= 1, got 0"):
        across_ranks.score_across_ranks(data, TorchSamplingClient(tiny_model()), SEQUENCES, progress=False, shard_unit=0)


def test_good_scoring_options_are_kept_as_given(tmp_path: Path) -> None:
    options = ScoringOptions(
        cache_path=tmp_path / CACHE_FILE_NAME, reference_fingerprint="ref", cache_tag="policy|precision=bf16-mixed",
        progress=False, shard_unit=2, cached_only="why", scoring_timeout=None, datum_name=datum_label,
    )
    assert options.cache_path == str(tmp_path / CACHE_FILE_NAME) and options.shard_unit == 2
    assert options.scoring_timeout is None and options.datum_name is datum_label and options.cached_only == "why"


def test_from_settings_refuses_what_is_not_torch_client_settings() -> None:
    with pytest.raises(TypeError, match=r"settings must be a TorchClientSettings, got dict"):
        TorchSamplingClient.from_settings(tiny_model(), {"max_tokens_per_batch": 64})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"settings must be a TorchClientSettings, got NoneType"):
        TorchSamplingClient.from_settings(tiny_model(), None)  # type: ignore[arg-type]


def test_torch_client_settings_refuse_a_non_bool_output_head() -> None:
    with pytest.raises(TypeError, match="output_head must be a bool, got 'logits'"):
        TorchClientSettings(output_head="logits")  # type: ignore[arg-type]
