"""The DPO DataModule's reference logprobs: scored once, cached, resumable, sharded across ranks.

Real ``lightning.Trainer`` runs on CPU with a toy DPO module. The classes and the worker of the 2-rank
test are defined at module level so that the spawned ranks can unpickle them.
"""

from __future__ import annotations

import copy
import json
import mmap
import os
import re
import warnings
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import jsonargparse
import lightning as L
import numpy as np
import pytest
import safetensors
import torch
from torch import nn
from torch.utils.data import DataLoader
from lightning.pytorch.strategies import DDPStrategy

from loops_callbacks.data import (
    DPODataModule,
    DPOPairDataset,
    ReferenceCacheWarning,
    ReferenceConfig,
    ReferenceLogprobsMixin,
    Scoring,
    check_dpo_pairs,
    collate_dpo_pairs,
    dpo_pair_datums,
)
from loops_callbacks.fields import field_to_tensor, model_input_tokens
from loops_callbacks.helpers.datum import attach_reference_logprobs
from loops_callbacks.reference.across_ranks import ReferenceCacheError, score_across_ranks
from loops_callbacks.reference.cache import CacheKey, data_fingerprint, list_caches, read_cache, write_cache
from loops_callbacks.reference.clients import TorchSamplingClient
from loops_callbacks.types import Datum, ModelInput, TensorData
from tests.helpers import ToyDPO, free_port, run_two_ranks

os.environ.setdefault("WANDB_MODE", "offline")
VOCAB = 16


# ----------------------------------------------------------------------------- toys


def make_pairs(num_pairs: int, *, seed: int = 0) -> list[tuple[list[int], list[int], int]]:
    """``(chosen, rejected, prompt_length)``: a shared prompt, responses of different lengths."""
    generator = torch.Generator().manual_seed(seed)

    def ids(low: int, high: int) -> list[int]:
        length = int(torch.randint(low, high, (), generator=generator))
        return torch.randint(1, VOCAB, (length,), generator=generator).tolist()

    pairs = []
    for _ in range(num_pairs):
        prompt = ids(2, 6)
        pairs.append((prompt + ids(1, 6), prompt + ids(1, 6), len(prompt)))
    return pairs


def pair_datums(pairs: list[tuple[list[int], list[int], int]]) -> list[Datum]:
    return [datum for chosen, rejected, k in pairs for datum in dpo_pair_datums(chosen, rejected, prompt_length=k)]


def fake_logprobs(tokens: list[int]) -> list[float | None]:
    """A deterministic 'reference': element 0 None, the others depend on the token and its neighbour."""
    return [None] + [-0.125 * ((3 * tokens[i] + tokens[i - 1] + i) % 11) - 0.0625 for i in range(1, len(tokens))]


class CountingClient:
    """A SamplingClient with a fingerprint, counting the prompts it scores."""

    def __init__(self, fingerprint: str | None = "fake-reference-v1", vocab_size: int | None = VOCAB) -> None:
        if fingerprint is not None:
            self.fingerprint = lambda: fingerprint
        self.vocab_size = vocab_size
        self.scored = 0

    def compute_logprobs(self, prompt: Any) -> list[float | None]:
        self.scored += 1
        return fake_logprobs(model_input_tokens(prompt))


class ReportingDPODataModule(DPODataModule):
    """Writes, per rank, what the scoring did and the result.

    ``perturb_rank`` changes that rank's module weights in ``setup`` (as an unseeded init would);
    DDP gives every rank rank 0's weights afterwards, when it wraps the module.
    """

    def __init__(self, *args: Any, report_dir: str, perturb_rank: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.report_dir = report_dir
        self.perturb_rank = perturb_rank

    def setup(self, stage: str) -> None:
        if stage == "fit" and self.trainer.global_rank == self.perturb_rank:
            with torch.no_grad():
                self.trainer.lightning_module.head.bias.add_(1.0)
        super().setup(stage)

    def train_dataloader(self) -> DataLoader:
        loader = super().train_dataloader()
        report = {
            "source": self.reference_report.source,
            "scored_here": self.reference_report.scored_here,
            "ref_logprobs": ref_values(self.scored_pairs.datums()),
        }
        with open(os.path.join(self.report_dir, f"rank{self.trainer.global_rank}.json"), "w", encoding="utf-8") as file:
            json.dump(report, file)
        return loader


def fit(
    model: L.LightningModule,
    datamodule: L.LightningDataModule,
    root: Any,
    max_steps: int = 2,
    ckpt_path: str | None = None,
    **kwargs: Any,
) -> L.Trainer:
    options = {
        "default_root_dir": str(root),
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": max_steps,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        **kwargs,
    }
    trainer = L.Trainer(**options)
    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    return trainer


def ref_values(data: list[Any]) -> list[list[float]]:
    """Each datum's ``ref_logprobs`` as floats, whatever the field's kind (a float32 array, ``TensorData``)."""
    return [field_to_tensor(d.loss_fn_inputs["ref_logprobs"], where="test").tolist() for d in data]


def toy_model(seed: int = 0) -> ToyDPO:
    torch.manual_seed(seed)
    return ToyDPO()


# ----------------------------------------------------------------------------- the datum convention


def test_dpo_pair_datums_follow_the_loops_convention() -> None:
    chosen, rejected = dpo_pair_datums([7, 8, 9, 10], [7, 8, 11], prompt_length=2)
    assert chosen.model_input.to_ints() == [7, 8, 9, 10]
    assert chosen.loss_fn_inputs["target_tokens"].data == [8, 9, 10, 0]
    assert chosen.loss_fn_inputs["weights"].data == [0.0, 1.0, 1.0, 0.0]
    assert rejected.loss_fn_inputs["target_tokens"].data == [8, 11, 0]
    assert rejected.loss_fn_inputs["weights"].data == [0.0, 1.0, 0.0]
    assert chosen.loss_fn_inputs["weights"].dtype == "float32"
    assert chosen.loss_fn_inputs["target_tokens"].dtype == "int64"
    weighted, _ = dpo_pair_datums([1, 2, 3], [1, 4], chosen_weights=[0, 0.5, 1], rejected_weights=[0, 1])
    assert weighted.loss_fn_inputs["weights"].data == [0.5, 1.0, 0.0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"chosen": [1, 2, 3], "rejected": [1, 4, 5], "prompt_length": 2}, "differ at token 1: 2 vs 4"),
        ({"chosen": [1, 2], "rejected": [1, 2, 3], "prompt_length": 2}, "no response tokens in the chosen"),
        ({"chosen": [], "rejected": [1, 2], "prompt_length": 1}, "chosen sequence is empty"),
        ({"chosen": [1, 2], "rejected": [1, 3], "prompt_length": 0}, r"prompt_length must be an int >= 1 \(token 0 is never predicted\), got 0"),
        ({"chosen": [1, 2], "rejected": [1, 3]}, "give either prompt_length or both"),
        ({"chosen": [1, 2], "rejected": [1], "chosen_weights": [0, 1], "rejected_weights": [0, 1]}, "has 2 values"),
        ({"chosen": [1, 2], "rejected": [1, 3], "chosen_weights": [1, 1], "rejected_weights": [0, 1]}, "must be 0"),
    ],
)
def test_dpo_pair_datums_reject_bad_pairs(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dpo_pair_datums(**kwargs)
    with pytest.raises(TypeError, match="token ids must be ints"):
        dpo_pair_datums([1, 2.5], [1, 3], prompt_length=1)


# ----------------------------------------------------------------------------- scoring and the cache


def the_cache_file(directory: Any) -> Any:
    """The one reference-logprob cache file in ``directory`` (one file per cache key)."""
    (info,) = list_caches(directory)
    return type(directory)(info.path)


def test_scores_once_then_reuses_the_cache(tmp_path: Any) -> None:
    data = pair_datums(make_pairs(6))
    client = CountingClient()
    first = DPODataModule(data, batch_size=2, reference=client, progress=False)
    fit(toy_model(), first, tmp_path)
    assert client.scored == len(data)
    assert first.reference_report.source == "scored"
    assert the_cache_file(tmp_path / "reference_logprobs").is_file()
    # the values equal a direct attach_reference_logprobs call, bit for bit
    assert ref_values(first.scored_pairs.datums()) == ref_values(attach_reference_logprobs(data, CountingClient()))

    client.scored = 0
    second = DPODataModule(data, batch_size=2, reference=client, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReferenceCacheWarning)
        fit(toy_model(), second, tmp_path)
    assert client.scored == 0
    assert second.reference_report.source == "cache"
    assert ref_values(second.scored_pairs.datums()) == ref_values(first.scored_pairs.datums())
    assert [d.model_input.to_ints() for d in second.scored_pairs.datums()] == [d.model_input.to_ints() for d in data]
    assert "ref_logprobs" not in data[0].loss_fn_inputs  # the inputs are not modified


def test_changed_reference_weights_invalidate_the_cache(tmp_path: Any) -> None:
    data = pair_datums(make_pairs(4))
    first = DPODataModule(data, batch_size=2, cache_dir=str(tmp_path / "cache"), progress=False)
    fit(toy_model(0), first, tmp_path)
    other = toy_model(1)
    other_initial = copy.deepcopy(other)
    expected = ref_values(attach_reference_logprobs(data, TorchSamplingClient.snapshot(other)))
    second = DPODataModule(data, batch_size=2, cache_dir=str(tmp_path / "cache"), progress=False)
    with pytest.warns(ReferenceCacheWarning, match="the reference weights changed"):
        fit(other, second, tmp_path)
    assert second.reference_report.source == "scored"
    assert second.reference_report.cache_status == "stale"
    assert ref_values(second.scored_pairs.datums()) == expected
    assert ref_values(second.scored_pairs.datums()) != ref_values(first.scored_pairs.datums())
    # the replaced file now serves the new reference
    third = DPODataModule(data, batch_size=2, cache_dir=str(tmp_path / "cache"), progress=False)
    fit(other_initial, third, tmp_path, max_steps=1)
    assert third.reference_report.source == "cache"


def test_changed_data_or_dtype_invalidate_the_cache(tmp_path: Any) -> None:
    client = CountingClient()
    data = pair_datums(make_pairs(4))
    fit(toy_model(), DPODataModule(data, reference=client, progress=False), tmp_path)
    changed = pair_datums(make_pairs(4, seed=1))
    client.scored = 0
    module = DPODataModule(changed, reference=client, progress=False)
    with pytest.warns(ReferenceCacheWarning, match="the data changed"):
        fit(toy_model(), module, tmp_path)
    assert client.scored == len(changed)
    assert ref_values(module.scored_pairs.datums()) == ref_values(attach_reference_logprobs(changed, CountingClient()))
    # the same tokens in another order are other data too
    swapped = changed[2:4] + changed[0:2] + changed[4:]
    with pytest.warns(ReferenceCacheWarning, match="the data changed"):
        fit(toy_model(), DPODataModule(swapped, reference=client, progress=False), tmp_path)
    with pytest.warns(ReferenceCacheWarning, match="the scoring dtype changed"):
        fit(toy_model(), DPODataModule(swapped, reference=client, scoring=Scoring(scoring_dtype="bfloat16"),
                                          progress=False), tmp_path)


def _memmap_of(array: Any) -> Any:
    """The memory map under ``array`` (through its views and the buffers they were made from), if any."""
    while array is not None and not isinstance(array, (np.memmap, mmap.mmap)):
        array = array.obj if isinstance(array, memoryview) else getattr(array, "base", None)
    return array


def test_values_are_one_float32_buffer_and_a_cache_hit_is_read_into_memory(tmp_path: Any) -> None:
    data = pair_datums(make_pairs(6))
    num_tokens = sum(d.model_input.length for d in data)
    first = DPODataModule(data, batch_size=2, reference=CountingClient(), progress=False)
    fit(toy_model(), first, tmp_path, max_steps=1)
    second = DPODataModule(data, batch_size=2, reference=CountingClient(), progress=False)
    fit(toy_model(), second, tmp_path, max_steps=1)
    assert second.reference_report.source == "cache"
    for module in (first, second):
        fields = [d.loss_fn_inputs["ref_logprobs"] for d in module.scored_pairs.datums()]
        assert all(isinstance(f, np.ndarray) and f.dtype == np.float32 for f in fields)
        assert sum(f.nbytes for f in fields) == 4 * num_tokens  # 4 bytes a token, in one buffer
        assert all(np.shares_memory(f, fields[0].base if fields[0].base is not None else fields[0]) for f in fields)
        # the batches are cut from that buffer: the dataset's rows are views of it, not copies
        row = DPOPairDataset(module.scored_pairs)[0][0]["ref_logprobs"]
        assert np.shares_memory(row.numpy(), fields[0])
    # a hit is read into memory (not a map of the file, which another run could change or truncate)
    assert _memmap_of(second.scored_pairs.datums()[0].loss_fn_inputs["ref_logprobs"]) is None
    assert ref_values(second.scored_pairs.datums()) == ref_values(first.scored_pairs.datums())


def _truncate(path: Any) -> None:
    blob = path.read_bytes()
    path.write_bytes(blob[: len(blob) - 9])


def _flip_a_value_byte(path: Any) -> None:
    blob = bytearray(path.read_bytes())
    blob[-8] ^= 0x55  # inside the data (the checksum is in the metadata, at the start)
    path.write_bytes(bytes(blob))


def _garbage(path: Any) -> None:
    path.write_bytes(b"not a cache at all")


def _wrong_lengths(path: Any) -> None:
    # a whole, well-formed file for the right key whose lengths do not fit the data
    with safetensors.safe_open(str(path), "np") as file:
        metadata, datums = file.metadata(), file.get_slice("lengths").get_shape()[0]
    key = CacheKey(metadata["reference"], metadata["data"], metadata["dtype"])
    write_cache(path, key, [torch.zeros(3).double().numpy()] * datums)


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_truncate, "truncated"),
        (_flip_a_value_byte, "checksum"),
        (_garbage, "not a reference-logprob cache"),
        (_wrong_lengths, "lengths do not match"),
    ],
)
def test_damaged_cache_is_detected_and_rescored(tmp_path: Any, damage: Any, reason: str) -> None:
    data = pair_datums(make_pairs(4))
    client = CountingClient()
    first = DPODataModule(data, reference=client, progress=False)
    fit(toy_model(), first, tmp_path, max_steps=1)
    cache_file = the_cache_file(tmp_path / "reference_logprobs")
    damage(cache_file)
    client.scored = 0
    second = DPODataModule(data, reference=client, progress=False)
    with pytest.warns(ReferenceCacheWarning, match=reason):
        fit(toy_model(), second, tmp_path, max_steps=1)
    assert client.scored == len(data)
    assert second.reference_report.cache_status == "corrupt"
    assert ref_values(second.scored_pairs.datums()) == ref_values(first.scored_pairs.datums())
    key = CacheKey("fake-reference-v1", data_fingerprint([d.model_input.to_ints() for d in data]), "model")
    assert read_cache(cache_file, key, [d.model_input.length for d in data]).status == "hit"  # rewritten whole


def test_client_without_fingerprint_is_not_cached(tmp_path: Any) -> None:
    data = pair_datums(make_pairs(2))
    client = CountingClient(fingerprint=None)
    with pytest.warns(ReferenceCacheWarning, match="not cached"):
        fit(toy_model(), DPODataModule(data, reference=client, progress=False), tmp_path, max_steps=1)
    assert list_caches(tmp_path / "reference_logprobs") == []
    module = DPODataModule(data, reference=client, scoring=Scoring(reference_fingerprint="sampler@step-0"),
                           progress=False)
    fit(toy_model(), module, tmp_path, max_steps=1)
    client.scored = 0
    module = DPODataModule(data, reference=client, scoring=Scoring(reference_fingerprint="sampler@step-0"),
                           progress=False)
    fit(toy_model(), module, tmp_path, max_steps=1)
    assert client.scored == 0 and module.reference_report.source == "cache"


# ----------------------------------------------------------------------------- which reference


class WatchedDPO(ToyDPO):
    """``ToyDPO`` that records, for every forward outside a training step, what the trainer had set up."""

    def __init__(self) -> None:
        super().__init__()
        self.scoring_calls: list[dict[str, Any]] = []
        self.in_step = False

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.in_step:
            trainer = self._trainer
            self.scoring_calls.append(
                {
                    "optimizers": len(trainer.optimizers) if trainer is not None else 0,
                    "step": trainer.global_step if trainer is not None else -1,
                    "grad": torch.is_grad_enabled(),
                    "training": self.training,
                }
            )
        return super().forward(input_ids)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.in_step = True
        try:
            return super().training_step(batch, batch_idx)
        finally:
            self.in_step = False


def watched_model(seed: int) -> WatchedDPO:
    torch.manual_seed(seed)
    return WatchedDPO()


def test_default_reference_is_the_policy_itself_after_the_strategy_setup(tmp_path: Any, monkeypatch: Any) -> None:
    data = pair_datums(make_pairs(8))
    model = watched_model(3)
    initial = copy.deepcopy(model)
    copies: list[str] = []
    original_deepcopy = copy.deepcopy

    def counting_deepcopy(obj: Any, *args: Any) -> Any:
        if isinstance(obj, nn.Module):
            copies.append(type(obj).__name__)
        return original_deepcopy(obj, *args)

    monkeypatch.setattr(copy, "deepcopy", counting_deepcopy)
    module = DPODataModule(data, batch_size=2, progress=False)
    fit(model, module, tmp_path, max_steps=6)
    assert copies == []  # no copy of the weights, at any time
    assert model.scoring_calls, "the policy itself scored the pairs"
    # every scoring forward ran once the strategy had set up the optimizers, before step 1, in eval
    # mode and without autograd
    assert all(c == {"optimizers": 1, "step": 0, "grad": False, "training": False} for c in model.scoring_calls)
    assert model.training  # its mode given back
    assert not torch.equal(model.head.weight, initial.head.weight)  # training moved the weights
    expected = ref_values(attach_reference_logprobs(data, TorchSamplingClient.snapshot(initial)))
    assert_close_rows(ref_values(module.scored_pairs.datums()), expected, atol=1e-6)
    assert module.reference_report.source == "scored"
    # the values are float32 views of one buffer, not lists of Python floats
    fields = [d.loss_fn_inputs["ref_logprobs"] for d in module.scored_pairs.datums()]
    assert all(isinstance(f, np.ndarray) and f.dtype == np.float32 for f in fields)
    assert len({id(f.base) for f in fields}) == 1


def _trained_checkpoint(tmp_path: Any, data: list[Datum], seed: int = 3) -> tuple[Any, list[list[float]]]:
    """A first run with the default reference and the cache; its checkpoint and its reference values."""
    model = watched_model(seed)
    module = DPODataModule(data, batch_size=2, progress=False)
    trainer = fit(model, module, tmp_path, max_steps=4)
    ckpt = tmp_path / "trained.ckpt"
    trainer.save_checkpoint(ckpt)
    return ckpt, ref_values(module.scored_pairs.datums())


def test_resume_uses_the_cache_never_the_trained_or_a_fresh_module(tmp_path: Any) -> None:
    data = pair_datums(make_pairs(8))
    ckpt, expected = _trained_checkpoint(tmp_path, data)
    assert torch.load(ckpt, weights_only=False)["DPODataModule"]["reference_logprobs"]["reference_fingerprint"]
    # a fresh module with another (unseeded-like) initialization: irrelevant, the checkpoint's
    # weights are restored and the reference comes from the cache
    for seed in (3, 4):
        resumed_model = watched_model(seed)
        resumed = DPODataModule(data, batch_size=2, progress=False)
        with warnings.catch_warnings():
            warnings.simplefilter("error", ReferenceCacheWarning)
            fit(resumed_model, resumed, tmp_path, max_steps=6, ckpt_path=str(ckpt))
        assert resumed_model.scoring_calls == []  # nothing scored with the trained weights
        assert resumed.reference_report.source == "cache"
        assert ref_values(resumed.scored_pairs.datums()) == expected
        # and its checkpoints still name the initial policy
        assert resumed.state_dict()["reference_logprobs"] == torch.load(ckpt, weights_only=False)["DPODataModule"]["reference_logprobs"]


def test_resume_without_its_cache_is_an_error_that_names_the_fix(tmp_path: Any) -> None:
    data = pair_datums(make_pairs(6))
    ckpt, _ = _trained_checkpoint(tmp_path, data)
    cache_file = the_cache_file(tmp_path / "reference_logprobs")
    os.remove(cache_file)
    model = watched_model(3)
    with pytest.raises(ReferenceCacheError, match="does not exist") as error:
        fit(model, DPODataModule(data, batch_size=2, progress=False), tmp_path, max_steps=6, ckpt_path=str(ckpt))
    message = str(error.value)
    assert str(cache_file) in message and "reference=<a checkpoint of the initial policy" in message
    assert "resumes from" in message and model.scoring_calls == []
    with pytest.raises(ReferenceCacheError, match="the cache is off"):
        fit(watched_model(3), DPODataModule(data, use_cache=False, progress=False), tmp_path, ckpt_path=str(ckpt))


def test_resume_after_another_run_shared_the_cache_dir(tmp_path: Any) -> None:
    data = pair_datums(make_pairs(6))
    ckpt, expected = _trained_checkpoint(tmp_path, data, seed=3)
    mine = the_cache_file(tmp_path / "reference_logprobs")
    # another run (another initial policy, then other data) caches in the same directory: its own files
    with pytest.warns(ReferenceCacheWarning, match="the reference weights changed"):
        fit(watched_model(9), DPODataModule(data, batch_size=2, progress=False), tmp_path, max_steps=1)
    with pytest.warns(ReferenceCacheWarning, match="the data changed"):
        fit(watched_model(3), DPODataModule(pair_datums(make_pairs(6, seed=5)), progress=False), tmp_path, max_steps=1)
    assert len(list_caches(tmp_path / "reference_logprobs")) == 3
    model = watched_model(3)
    resumed = DPODataModule(data, batch_size=2, progress=False)
    fit(model, resumed, tmp_path, max_steps=6, ckpt_path=str(ckpt))  # the first run still resumes
    assert model.scoring_calls == [] and resumed.reference_report.source == "cache"
    assert ref_values(resumed.scored_pairs.datums()) == expected
    # without its own cache, the error names the others and why none matches
    os.remove(mine)
    with pytest.raises(ReferenceCacheError, match="none of the 2 cache.*the data changed.*reference weights changed"):
        fit(watched_model(3), DPODataModule(data, progress=False), tmp_path, max_steps=6, ckpt_path=str(ckpt))


def test_resume_from_a_checkpoint_that_does_not_name_its_reference(tmp_path: Any) -> None:
    data = pair_datums(make_pairs(6))
    ckpt, expected = _trained_checkpoint(tmp_path, data)
    checkpoint = torch.load(ckpt, weights_only=False)
    del checkpoint["DPODataModule"]
    torch.save(checkpoint, tmp_path / "anonymous.ckpt")
    resumed = DPODataModule(data, batch_size=2, progress=False)
    with pytest.warns(ReferenceCacheWarning, match="does not record which initial policy"):
        fit(watched_model(3), resumed, tmp_path, max_steps=6, ckpt_path=str(tmp_path / "anonymous.ckpt"))
    assert ref_values(resumed.scored_pairs.datums()) == expected


def test_scored_pairs_before_the_strategy_setup_are_an_error(tmp_path: Any) -> None:
    class Early(DPODataModule):
        def setup(self, stage: str) -> None:
            super().setup(stage)
            _ = self.scored_pairs

    with pytest.raises(RuntimeError, match="before the strategy set the LightningModule up"):
        fit(toy_model(), Early(pair_datums(make_pairs(2)), progress=False), tmp_path, max_steps=1)


class BuiltInConfigureModel(ToyDPO):
    """Layers made in ``configure_model`` (as FSDP users do): none exist at ``setup``."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        self.lr, self.beta = 0.5, 0.5
        self.embed: nn.Module | None = None

    def configure_model(self) -> None:
        if self.embed is None:
            torch.manual_seed(21)
            self.embed, self.head = nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB)


def test_a_model_built_in_configure_model_is_its_own_reference(tmp_path: Any) -> None:
    data = pair_datums(make_pairs(4))
    model = BuiltInConfigureModel()
    module = DPODataModule(data, batch_size=2, use_cache=False, progress=False)
    fit(model, module, tmp_path, max_steps=1)
    torch.manual_seed(21)
    reference = nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB))
    assert_close_rows(ref_values(module.scored_pairs.datums()), ref_values(attach_reference_logprobs(data, TorchSamplingClient(reference))))


def test_a_callable_reference(tmp_path: Any) -> None:
    data = pair_datums(make_pairs(4))
    reference = toy_model(8).eval()
    module = DPODataModule(data, reference=lambda ids: reference(ids), progress=False)
    with pytest.warns(ReferenceCacheWarning, match="not cached"):
        fit(toy_model(), module, tmp_path, max_steps=1)
    assert_close_rows(ref_values(module.scored_pairs.datums()), ref_values(attach_reference_logprobs(data, TorchSamplingClient(reference))))
    module = DPODataModule(data, reference=lambda ids: reference(ids), scoring=Scoring(reference_fingerprint="toy-8"),
                           progress=False)
    fit(toy_model(), module, tmp_path, max_steps=1)
    assert the_cache_file(tmp_path / "reference_logprobs").is_file()


def test_checkpoint_and_module_references(tmp_path: Any) -> None:
    data = pair_datums(make_pairs(4))
    reference = toy_model(7)
    expected = ref_values(attach_reference_logprobs(data, TorchSamplingClient.snapshot(reference)))
    # a Lightning checkpoint of the reference module
    trainer = L.Trainer(default_root_dir=str(tmp_path), accelerator="cpu", logger=False, enable_progress_bar=False)
    trainer.strategy.connect(reference)
    trainer.save_checkpoint(tmp_path / "reference.ckpt")
    torch.save(reference.state_dict(), tmp_path / "reference.pt")
    for path in ("reference.ckpt", "reference.pt"):
        module = DPODataModule(data, reference=str(tmp_path / path), use_cache=False, progress=False)
        fit(toy_model(0), module, tmp_path, max_steps=1)
        assert ref_values(module.scored_pairs.datums()) == expected, path
    # an nn.Module is scored as a frozen copy: the module itself is not cast
    module = DPODataModule(data, reference=reference, scoring=Scoring(scoring_dtype="float16"), use_cache=False,
                           progress=False)
    fit(toy_model(0), module, tmp_path, max_steps=1)
    assert next(reference.parameters()).dtype == torch.float32
    half = ref_values(attach_reference_logprobs(data, TorchSamplingClient.snapshot(reference, dtype="float16")))
    assert ref_values(module.scored_pairs.datums()) == half
    # a checkpoint that does not fit the module
    torch.save({"state_dict": {"other.weight": torch.zeros(2)}}, tmp_path / "bad.ckpt")
    with pytest.raises(ValueError, match="missing keys"):
        fit(toy_model(0), DPODataModule(data, reference=str(tmp_path / "bad.ckpt"), progress=False), tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        fit(toy_model(0), DPODataModule(data, reference=str(tmp_path / "nope.ckpt"), progress=False), tmp_path)


# ----------------------------------------------------------------------------- batches


def test_batches_hold_whole_pairs_in_the_agreed_format(tmp_path: Any) -> None:
    pairs = make_pairs(7)
    data = pair_datums(pairs)
    module = DPODataModule(data, batch_size=3, reference=CountingClient(), use_cache=False, progress=False, seed=1)
    fit(toy_model(), module, tmp_path, max_steps=3)
    expected_ref = {tuple(d.model_input.to_ints()): d.loss_fn_inputs["ref_logprobs"].data for d in module.scored_pairs.datums()}
    by_chosen = {tuple(chosen): (rejected, k) for chosen, rejected, k in pairs}
    seen = []
    for batch in module.train_dataloader():
        assert set(batch) == {"input_ids", "target_tokens", "weights", "ref_logprobs", "attention_mask"}
        rows, width = batch["input_ids"].shape
        assert rows % 2 == 0 and rows <= 6
        assert batch["input_ids"].dtype == torch.long and batch["target_tokens"].dtype == torch.long
        assert batch["weights"].dtype == torch.float32 and batch["ref_logprobs"].dtype == torch.float32
        assert batch["attention_mask"].dtype == torch.bool
        for key in batch:
            assert batch[key].shape == (rows, width)
        assert width == int(batch["attention_mask"].sum(1).max())
        for i in range(0, rows, 2):
            chosen_row, rejected_row = (batch["input_ids"][r][batch["attention_mask"][r]].tolist() for r in (i, i + 1))
            rejected, k = by_chosen[tuple(chosen_row)]
            assert rejected_row == rejected  # the pair is whole, chosen first
            seen.append(tuple(chosen_row))
            for r, tokens in ((i, chosen_row), (i + 1, rejected_row)):
                n = len(tokens)
                assert batch["target_tokens"][r].tolist() == tokens[1:] + [0] * (width - n + 1)
                assert batch["weights"][r].tolist() == [0.0] * (k - 1) + [1.0] * (n - k) + [0.0] * (width - n + 1)
                assert batch["ref_logprobs"][r, :n].tolist() == pytest.approx(expected_ref[tuple(tokens)], abs=1e-7)
                assert batch["ref_logprobs"][r, n:].abs().sum() == 0
                assert not batch["attention_mask"][r, n:].any()
    assert sorted(seen) == sorted(tuple(c) for c, _, _ in pairs)


def test_validation_split_and_user_mixin(tmp_path: Any) -> None:
    data = pair_datums(make_pairs(10))
    module = DPODataModule(
        data, batch_size=4, reference=CountingClient(), val_fraction=0.3, use_cache=False, progress=False
    )
    fit(toy_model(), module, tmp_path, max_steps=2, limit_val_batches=0)
    train = [tuple(t) for b in module.train_dataloader() for t in b["input_ids"][0::2].tolist()]
    val = [tuple(t) for b in module.val_dataloader() for t in b["input_ids"][0::2].tolist()]
    assert len(train) == 7 and len(val) == 3 and not set(train) & set(val)

    # Under DDP every held-out pair is validated on exactly one rank (Lightning's own sampler would
    # repeat one to give both ranks 2, and it would count twice in val/*).
    fitted_trainer = module.trainer
    per_rank = []
    for rank in range(2):
        module.trainer = SimpleNamespace(world_size=2, global_rank=rank)
        per_rank.append([row[row != 0].tolist() for b in module.val_dataloader() for row in b["input_ids"][0::2]])
    module.trainer = fitted_trainer
    unpadded = sorted([token for token in t if token != 0] for t in val)  # 0 pads; the pairs' ids are > 0
    assert sorted(per_rank[0] + per_rank[1]) == unpadded and [len(p) for p in per_rank] == [2, 1]

    class MyData(ReferenceLogprobsMixin, L.LightningDataModule):
        def __init__(self, reference: Any = None, cache_dir: str | None = None) -> None:
            super().__init__()
            self.configure_reference(reference, cache_dir=cache_dir, progress=False)

        def dpo_data(self) -> list[Datum]:
            return data

        def train_dataloader(self) -> DataLoader:
            return DataLoader(DPOPairDataset(self.scored_pairs), batch_size=2, collate_fn=collate_dpo_pairs)

    mine = MyData(cache_dir=str(tmp_path / "mine"))
    model = toy_model(5)
    expected = ref_values(attach_reference_logprobs(data, TorchSamplingClient.snapshot(model)))
    fit(model, mine, tmp_path, max_steps=2)
    assert ref_values(mine.scored_pairs.datums()) == expected
    assert the_cache_file(tmp_path / "mine").is_file()
    with pytest.raises(RuntimeError, match="setup\\('fit'\\)"):
        _ = MyData().scored_pairs


# ----------------------------------------------------------------------------- bad data


def _datum(tokens: list[int], weights: list[float] | None = None) -> Datum:
    inputs = {} if weights is None else {"weights": TensorData(weights, "float32", [len(weights)])}
    return Datum(ModelInput.from_ints(tokens), inputs)


def bad_data(case: str) -> list[Datum]:
    """Three good pairs (datums 0-5), spoiled in one way."""
    good = pair_datums(make_pairs(3))
    if case == "none":
        return []
    if case == "odd":
        return good + [good[0]]
    if case == "prompts differ":
        chosen, _ = dpo_pair_datums([1, 2, 3], [1, 2, 4], prompt_length=2)
        _, rejected = dpo_pair_datums([1, 9, 3], [1, 9, 4], prompt_length=2)
        return good[:2] + [chosen, rejected] + good[4:]
    if case == "prompt lengths differ":
        return good[:4] + [_datum([1, 2, 3], [0.0, 1.0, 0.0]), _datum([1, 2], [1.0, 0.0])]
    if case == "empty":
        return good[:3] + [_datum([])] + good[4:]
    if case == "outside the vocabulary":
        return good[:4] + [_datum([1, 2, VOCAB]), good[5]]
    if case == "negative id":
        return good[:1] + [_datum([1, -3])] + good[2:]
    if case == "weights too short":
        return good[:2] + [_datum([1, 2, 3], [0.0, 1.0])] + good[3:]
    raise AssertionError(case)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("none", "no datums"),
        ("odd", r"odd number of datums \(7\).*pair 3 \(datum 6\) has no rejected datum"),
        (
            "prompts differ",
            r"pair 1: the chosen \(datum 2\) and rejected \(datum 3\) prompts differ at token 1: 2 vs 9",
        ),
        ("prompt lengths differ", r"pair 2: .* prompts differ: .* chosen prompt has 2 tokens and the rejected 1"),
        ("empty", r"pair 1: the rejected datum \(index 3\) has an empty model_input"),
        (
            "outside the vocabulary",
            r"pair 2: the chosen datum \(index 4\) has token id 16 at position 2, "
            r"outside the reference's vocabulary \[0, 16\)",
        ),
        ("negative id", r"pair 0: the rejected datum \(index 1\) has token id -3 at position 1"),
        ("weights too short", r"pair 1: the chosen datum \(index 2\): 'weights' has 2 values for a model_input of 3"),
    ],
)
def test_bad_data_name_the_pair_before_any_scoring(tmp_path: Any, case: str, message: str) -> None:
    client = CountingClient()
    with pytest.raises(ValueError, match=message):
        fit(toy_model(), DPODataModule(bad_data(case), reference=client, progress=False), tmp_path)
    assert client.scored == 0


def test_a_failing_reference_fails_the_run_and_caches_nothing(tmp_path: Any) -> None:
    class Broken(CountingClient):
        def compute_logprobs(self, prompt: Any) -> list[float | None]:
            raise RuntimeError("the sampler is down")

    with pytest.raises(RuntimeError, match="the sampler is down"):
        fit(toy_model(), DPODataModule(pair_datums(make_pairs(2)), reference=Broken(), progress=False), tmp_path)
    assert list_caches(tmp_path / "reference_logprobs") == []


class _TwoRanks:
    """Rank 1 of two, where rank 0's scoring failed (stands in for ``torch.distributed``)."""

    rank, world_size = 1, 2
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.failed = False

    def all_gather_objects(self, obj: Any) -> list[Any]:
        return [("RuntimeError", "out of memory"), obj] if self.failed else [obj, obj]  # raise_together's form

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank 0's object: this rank's own, or, where only rank 0 holds one (the cache lookup), no cache found."""
        from loops_callbacks.reference.cache import CacheLookup

        return CacheLookup("missing") if obj is None else obj

    def any_true(self, flag: bool) -> bool:
        self.failed = True  # rank 0's flag
        return True

    def max_int(self, value: int) -> int:
        return value

    def warn_once(self, message: str, category: type[Warning] = UserWarning) -> None:
        pass


def test_a_failure_on_another_rank_fails_this_rank_too(tmp_path: Any, monkeypatch: Any) -> None:
    from loops_callbacks.reference import across_ranks

    monkeypatch.setattr(across_ranks, "ProcessGroup", _TwoRanks)
    client = CountingClient()
    data = pair_datums(make_pairs(4))
    config = ReferenceConfig(progress=False, cache_dir=str(tmp_path / "c"))
    with pytest.raises(RuntimeError, match="failed on another rank \\(rank 0: RuntimeError: out of memory\\)"):
        score_across_ranks(check_dpo_pairs(data).tokens, client, config, shard_unit=2)
    lengths = np.array([d.model_input.length for d in data])
    bounds = across_ranks._shard_bounds(lengths, 2, 2)
    assert 0 < client.scored == bounds[2] - bounds[1] < len(data)  # rank 1 scored its own block only
    assert not (tmp_path / "c").exists()


def test_jsonl_input(tmp_path: Any) -> None:
    pairs = make_pairs(5)
    path = tmp_path / "pairs.jsonl"
    lines = [json.dumps({"chosen": c, "rejected": r, "prompt_length": k, "id": i}) for i, (c, r, k) in enumerate(pairs)]
    c, r, k = pairs[0]
    weighted = {
        "chosen": c,
        "rejected": r,
        "chosen_weights": [0.0] * k + [1.0] * (len(c) - k),
        "rejected_weights": [0.0] * k + [1.0] * (len(r) - k),
    }
    path.write_text("\n".join(lines[:2]) + "\n\n" + "\n".join(lines[2:]) + "\n" + json.dumps(weighted) + "\n")
    from_file = DPODataModule(jsonl_path=str(path), reference=CountingClient(), use_cache=False, progress=False)
    fit(toy_model(), from_file, tmp_path, max_steps=1)
    expected = attach_reference_logprobs(pair_datums(pairs + [pairs[0]]), CountingClient())
    assert [d.model_input.to_ints() for d in from_file.scored_pairs.datums()] == [d.model_input.to_ints() for d in expected]
    weights = [d.loss_fn_inputs["weights"].data for d in from_file.scored_pairs.datums()]
    assert weights == [d.loss_fn_inputs["weights"].data for d in expected]
    assert ref_values(from_file.scored_pairs.datums()) == ref_values(expected)
    # records in memory are the same as the file
    records = [json.loads(line) for line in lines]
    in_memory = DPODataModule(records, reference=CountingClient(), use_cache=False, progress=False)
    fit(toy_model(), in_memory, tmp_path, max_steps=1)
    assert ref_values(in_memory.scored_pairs.datums()) == ref_values(expected)[:-2]

    bad = tmp_path / "bad.jsonl"
    mismatch = {"chosen": [1, 2, 3], "rejected": [1, 5, 3], "prompt_length": 2}
    bad.write_text(lines[0] + "\n" + json.dumps(mismatch) + "\n")
    where = re.escape(f"pair 1 (line 2 of {bad}): ")
    with pytest.raises(ValueError, match=where + "the chosen and rejected prompts .* differ at token 1: 2 vs 5"):
        fit(toy_model(), DPODataModule(jsonl_path=str(bad), reference=CountingClient(), progress=False), tmp_path)
    bad.write_text(lines[0] + "\n{not json\n")
    with pytest.raises(ValueError, match="pair 1 \\(line 2 .*not valid JSON"):
        fit(toy_model(), DPODataModule(jsonl_path=str(bad), reference=CountingClient(), progress=False), tmp_path)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of data, path, dataset and jsonl_path, got neither"),
        ({"data": [], "jsonl_path": "x.jsonl"}, "got data and jsonl_path"),
        ({"path": "x.jsonl", "dataset": {"path": "json"}}, "got path and dataset"),
        ({"dataset": {"data_files": "x.jsonl"}}, "load_dataset arguments with a 'path'"),
        ({"path": "x.jsonl", "max_length": 1}, r"max_length must be an int >= 2 or None, got 1"),
        ({"path": "x.jsonl", "max_length": 8, "max_prompt_length": 8}, "max_prompt_length=8 must be less than"),
        ({"data": [], "batch_size": 0}, "batch_size must be an int >= 1, got 0"),
        ({"data": [], "scoring": Scoring(scoring_dtype="float64")}, "scoring_dtype='float64' is not one of"),
        ({"data": [], "scoring": Scoring(max_tokens_per_batch=-5)}, "max_tokens_per_batch must be an int >= 1 or None, got -5"),
        ({"data": [], "val_fraction": 1.0}, r"val_fraction must be a number in \[0, 1\), got 1.0"),
        ({"data": [], "num_workers": -1}, "num_workers must be an int >= 0, got -1"),
    ],
)
def test_constructor_arguments_are_checked(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DPODataModule(**kwargs)
    with pytest.raises(TypeError, match="a file goes in path="):
        DPODataModule(data="pairs.jsonl")


def test_yaml_configs_parse(tmp_path: Any) -> None:
    pairs = tmp_path / "pairs.jsonl"  # made with the module: one that does not exist is refused then
    pairs.write_text('{"chosen": [1, 2], "rejected": [1, 3], "prompt_length": 1}\n')
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(DPODataModule, "data")
    config = parser.parse_string(
        f"data:\n  jsonl_path: {pairs}\n  reference: path/to.ckpt\n  scoring:\n    scoring_dtype: bfloat16\n"
        "  batch_size: 4\n"
    )
    assert config.data.reference == "path/to.ckpt" and config.data.scoring.scoring_dtype == "bfloat16"
    module = parser.instantiate(config).data
    assert isinstance(module, DPODataModule) and module.reference_config.reference == "path/to.ckpt"
    assert module.reference_config.scoring_dtype == "bfloat16"
    config = parser.parse_string("data:\n  data: [{chosen: [1, 2, 3], rejected: [1, 2, 4], prompt_length: 2}]\n")
    assert config.data.reference is None
    assert parser.instantiate(config).data.dpo_data().datums()[1].model_input.to_ints() == [1, 2, 4]
    with pytest.raises(jsonargparse.ArgumentError):
        parser.parse_string("data:\n  jsonl_path: pairs.jsonl\n  scoring:\n    scoring_dtype: float64\n")


# ----------------------------------------------------------------------------- two ranks


def _two_ddp_fits(rank: int, port: int, root: str) -> None:
    """One rank of two 2-step DDP fits in one process group: one that scores (rank 1's weights perturbed
    before DDP gives every rank rank 0's), then one that finds the cache the first wrote. Their reports
    go in ``<root>/scored`` and ``<root>/cached``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        data, cache_dir = pair_datums(make_pairs(9)), os.path.join(root, "cache")
        for name, perturb_rank in (("scored", 1), ("cached", None)):
            os.makedirs(os.path.join(root, name), exist_ok=True)
            module = ReportingDPODataModule(data, batch_size=2, cache_dir=cache_dir, progress=False,
                                            report_dir=os.path.join(root, name), perturb_rank=perturb_rank)
            fit(toy_model(11), module, root, strategy=DDPStrategy(timeout=timedelta(seconds=60)), devices=2)
        torch.save(None, os.path.join(root, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


def assert_close_rows(actual: list[list[float]], expected: list[list[float]], atol: float = 1e-6) -> None:
    assert [len(row) for row in actual] == [len(row) for row in expected]
    for row, want in zip(actual, expected):
        assert row == pytest.approx(want, abs=atol)


def _reports(report_dir: Any) -> list[dict[str, Any]]:
    reports = []
    for rank in (0, 1):
        with open(report_dir / f"rank{rank}.json", encoding="utf-8") as file:
            reports.append(json.load(file))
        os.remove(report_dir / f"rank{rank}.json")
    return reports


def test_two_ranks_each_score_half_and_agree_with_one_process(tmp_path: Any) -> None:
    data = pair_datums(make_pairs(9))
    model = toy_model(11)
    single = DPODataModule(data, batch_size=2, use_cache=False, progress=False)
    fit(copy.deepcopy(model), single, tmp_path)
    expected = ref_values(single.scored_pairs.datums())

    # the default reference under DDP: each rank scores one block of pairs with the policy itself,
    # after DDP has given it rank 0's weights (rank 1's were perturbed in setup); then a second
    # run finds the cache rank 0 wrote: nothing is scored on either rank
    run_two_ranks(_two_ddp_fits, (free_port(), str(tmp_path)), tmp_path, "the two DDP fits")
    reports = _reports(tmp_path / "scored")
    assert [r["source"] for r in reports] == ["scored", "scored"]
    assert sum(r["scored_here"] for r in reports) == len(data) and all(r["scored_here"] > 0 for r in reports)
    for report in reports:
        assert_close_rows(report["ref_logprobs"], expected)

    reports = _reports(tmp_path / "cached")
    assert [(r["source"], r["scored_here"]) for r in reports] == [("cache", 0), ("cache", 0)]
    for report in reports:
        assert_close_rows(report["ref_logprobs"], expected)
