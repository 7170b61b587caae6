"""One ``ReferenceConfig`` from the DataModule to the scorer; the cache tag is its own field of the key."""

from __future__ import annotations

from typing import Any

import pytest

from loops_callbacks.data import DPODataModule
from loops_callbacks.reference import policy as policy_module
from loops_callbacks.reference.config import ReferenceConfig
from loops_callbacks.reference.policy import PolicyReference
from tests.data.test_data import fit, make_pairs, pair_datums, toy_model


def test_the_datamodules_config_reaches_the_policy_scorer_unchanged(tmp_path: Any, monkeypatch: Any) -> None:
    seen: list[Any] = []
    original = PolicyReference.from_trainer.__func__

    def spy(cls: type, trainer: Any, config: Any = None) -> PolicyReference:
        seen.append(config)
        return original(cls, trainer, config)

    monkeypatch.setattr(policy_module.PolicyReference, "from_trainer", classmethod(spy))
    data = DPODataModule(pair_datums(make_pairs(4)), batch_size=2, progress=False, max_tokens_per_batch=64)
    fit(toy_model(), data, tmp_path, max_steps=1)
    (config,) = seen
    assert isinstance(config, ReferenceConfig) and config.max_tokens_per_batch == 64 and config.progress is False
    assert config.reference is None and config.scoring_timeout == data.reference_config.scoring_timeout


def test_the_policys_cache_key_has_the_precision_tag_not_a_dtype(tmp_path: Any) -> None:
    data = DPODataModule(pair_datums(make_pairs(4)), batch_size=2, progress=False)
    fit(toy_model(), data, tmp_path, max_steps=1)
    assert data.reference_report.cache_key.dtype == "policy|precision=32-true"  # the key's text as before
    assert data.reference_config.scoring_dtype is None


def test_the_config_is_frozen_and_names_the_cache_tag() -> None:
    config = ReferenceConfig(scoring_dtype="float16")
    assert config.cache_tag() == "float16" and ReferenceConfig().cache_tag() == "model"
    with pytest.raises(AttributeError):
        config.max_tokens_per_batch = 8  # type: ignore[misc]
