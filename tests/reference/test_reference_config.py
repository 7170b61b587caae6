"""One ``ReferenceConfig`` from the DataModule to the scorer: each field checked when made (a wrong type a
``TypeError``, a wrong value a ``ValueError``, naming both), its settings given to a local reference, the cache tag
its own field of the key."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from loops_callbacks.data import DPODataModule, Scoring
from loops_callbacks.reference import policy as policy_module
from loops_callbacks.reference.clients import TorchSamplingClient
from loops_callbacks.reference.config import ReferenceConfig, resolve_reference
from loops_callbacks.reference.policy import PolicyReference
from tests.data.test_data import fit, make_pairs, pair_datums, toy_model


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))


@pytest.mark.parametrize(
    ("field", "value", "error", "message"),
    [
        ("max_tokens_per_batch", 0, ValueError, "max_tokens_per_batch must be an int >= 1 or None, got 0"),
        ("max_tokens_per_batch", 2.0, TypeError, "max_tokens_per_batch must be an int >= 1 or None, got 2.0"),
        ("progress", 1, TypeError, "progress must be a bool, got 1"),
        ("use_cache", "no", TypeError, "use_cache must be a bool, got 'no'"),
        ("cache_dir", 3, TypeError, "cache_dir must be a path or None, got 3"),
        ("reference_fingerprint", b"ab", TypeError, "reference_fingerprint must be a string or None, got b'ab'"),
        ("scoring_dtype", "float64", ValueError, "scoring_dtype='float64' is not one of"),
        ("scoring_timeout", 0, ValueError, "scoring_timeout must be a number of seconds > 0, or None for no limit"),
        ("scoring_timeout", "30", TypeError, "scoring_timeout must be a number of seconds > 0"),
        ("reference", "", ValueError, "reference='' is not a path; use None for the LightningModule itself"),
    ],
)
def test_a_bad_field_is_refused_naming_it_and_the_value(
    field: str, value: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        ReferenceConfig(**{field: value})


def test_the_config_is_frozen_and_names_the_cache_tag() -> None:
    config = ReferenceConfig(scoring_dtype="float16", scoring_timeout=None)
    assert config.cache_tag() == "float16" and ReferenceConfig().cache_tag() == "model"
    with pytest.raises(AttributeError):
        config.max_tokens_per_batch = 8  # type: ignore[misc]


def test_the_datamodules_settings_reach_the_policy_scorer(tmp_path: Any, monkeypatch: Any) -> None:
    seen: list[dict[str, Any]] = []
    original = PolicyReference.from_trainer.__func__

    def spy(cls: type, trainer: Any, **settings: Any) -> PolicyReference:
        seen.append(settings)
        return original(cls, trainer, **settings)

    monkeypatch.setattr(policy_module.PolicyReference, "from_trainer", classmethod(spy))
    data = DPODataModule(pair_datums(make_pairs(4)), batch_size=2, progress=False,
                         scoring=Scoring(max_tokens_per_batch=64))
    fit(toy_model(), data, tmp_path, max_steps=1)
    assert seen == [{"scoring_dtype": None, "max_tokens_per_batch": 64}]
    assert data.reference_config.reference is None and data.reference_config.progress is False


def test_the_policys_cache_key_has_the_precision_tag_not_a_dtype(tmp_path: Any) -> None:
    data = DPODataModule(pair_datums(make_pairs(4)), batch_size=2, progress=False)
    fit(toy_model(), data, tmp_path, max_steps=1)
    assert data.reference_report.cache_key.dtype == "policy|precision=32-true"  # the key's text as before
    assert data.reference_config.scoring_dtype is None


def test_snapshot_checks_its_settings_before_the_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    client = TorchSamplingClient.snapshot(tiny_model(), dtype="float64", device="cpu", max_tokens_per_batch=64)
    assert client.dtype == torch.float64 and client.device == torch.device("cpu") and client.max_tokens_per_batch == 64
    copies: list[Any] = []
    monkeypatch.setattr("copy.deepcopy", lambda module: copies.append(module))
    with pytest.raises(ValueError, match="max_tokens_per_batch must be an int >= 1 or None, got 0"):
        TorchSamplingClient.snapshot(tiny_model(), max_tokens_per_batch=0)
    with pytest.raises(TypeError, match="output_head must be a bool, got 'logits'"):
        TorchSamplingClient.snapshot(tiny_model(), output_head="logits")  # type: ignore[arg-type]
    assert copies == []  # refused before any copy of the weights


def test_resolve_reference_gives_a_local_reference_the_configs_settings() -> None:
    config = ReferenceConfig(scoring_dtype="bfloat16", max_tokens_per_batch=96)
    module = tiny_model()
    client = resolve_reference(module, config=config, device="cpu")
    assert (client.dtype, client.device, client.max_tokens_per_batch) == (torch.bfloat16, torch.device("cpu"), 96)
    assert client.model is not module and not client.model.training
    assert next(module.parameters()).dtype == torch.float32  # the module itself is not cast
    plain = resolve_reference(lambda ids: torch.zeros(*ids.shape, 4), config=ReferenceConfig(max_tokens_per_batch=96))
    assert plain.max_tokens_per_batch == 96 and plain.dtype is None
    with pytest.raises(ValueError, match="dtype='bfloat16' cannot cast a plain callable reference"):
        resolve_reference(lambda ids: torch.zeros(*ids.shape, 4), config=config)
