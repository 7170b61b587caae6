"""DPO on a Hugging Face causal LM from text and chat preference data: the module, the DataModule, the CLI.

Every model is a tiny randomly initialised Llama-style model built from a config dict; the
tokenizer and the chat pairs are the ones shipped in ``configs/data``. Nothing is downloaded.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import jsonargparse
import pytest
import torch
import yaml

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from loops_callbacks.cli import run_cli  # noqa: E402
from loops_callbacks.data import DPODataModule, ReferenceCacheWarning  # noqa: E402
from loops_callbacks.optional import HF_EXTRA_HINT, import_optional  # noqa: E402
from loops_callbacks.data.tokenization import PreferenceDataWarning  # noqa: E402
from loops_callbacks.demo import dpo as demo_dpo  # noqa: E402
from loops_callbacks.models import DPOModule, HFDPOModule, dpo_loss  # noqa: E402
from tests.helpers import quiet_trainer  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers", "ignore:.*LeafSpec"),
]

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
TOKENIZER = str(CONFIGS / "data" / "chat_tokenizer")
PAIRS = str(CONFIGS / "data" / "chat_preferences.jsonl")
TINY = {"model_type": "llama", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 256}


@pytest.fixture(autouse=True)
def datasets_cache_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_datasets_cache"))


def tiny_module(**kwargs: Any) -> HFDPOModule:
    torch.manual_seed(0)
    return HFDPOModule({"config": TINY, "tokenizer": TOKENIZER}, lr=1e-3, **kwargs)


def small_pairs(tmp_path: Path, count: int = 24) -> str:
    path = tmp_path / "pairs.jsonl"
    with open(PAIRS, encoding="utf-8") as file:
        path.write_text("".join(file.readlines()[:count]))
    return str(path)


def fit(module: Any, data: DPODataModule, root: Path, **kwargs: Any) -> Any:
    trainer = quiet_trainer(max_steps=kwargs.pop("max_steps", 2), default_root_dir=str(root), **kwargs)
    trainer.fit(module, datamodule=data)
    return trainer


# ----------------------------------------------------------------------------- the module


def test_a_config_dict_makes_a_random_model_sized_to_its_tokenizer() -> None:
    module = tiny_module()
    assert module.tokenizer_name_or_path == TOKENIZER and module.vocab_size == 512  # from the tokenizer
    logits = module(torch.tensor([[1, 2, 3]]))
    assert logits.shape == (1, 3, 512)
    flat = HFDPOModule({**TINY, "vocab_size": 64})
    assert flat.tokenizer_name_or_path is None and flat.vocab_size == 64
    assert isinstance(module, DPOModule) and issubclass(demo_dpo.DPOPolicyModule, DPOModule)
    assert demo_dpo.dpo_loss is dpo_loss  # one formula


def test_a_checkpoint_path_brings_its_weights_and_tokenizer(tmp_path: Path) -> None:
    module = tiny_module()
    module.model.save_pretrained(tmp_path / "ckpt")
    transformers.AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(tmp_path / "ckpt")
    loaded = HFDPOModule(str(tmp_path / "ckpt"))
    assert loaded.tokenizer_name_or_path == str(tmp_path / "ckpt") and loaded.lr == 1e-6  # TRL's default
    ids = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(loaded(ids), module(ids))


@pytest.mark.parametrize(
    ("model", "error", "message"),
    [
        ({"hidden_size": 8}, ValueError, "has no 'model_type'"),
        ({"config": TINY, "tokeniser": TOKENIZER}, ValueError, r"got keys \['config', 'tokeniser'\]"),
        ({"config": TINY, "tokenizer": 5}, TypeError, "must be a name or path"),
        (7, TypeError, "must be a checkpoint name/path or a config dict"),
    ],
)
def test_bad_model_arguments_are_named(model: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        HFDPOModule(model)


def test_without_the_hf_extra_the_message_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=re.escape(f"HFDPOModule needs the 'transformers' package, part of the 'hf' extra: {HF_EXTRA_HINT}")):
        HFDPOModule({"config": TINY})
    with pytest.raises(ImportError, match=re.escape(HF_EXTRA_HINT)):
        import_optional("transformers", "x")


WITHOUT_THE_HF_EXTRA = """
import importlib.abc, importlib.metadata as metadata, sys

HIDDEN = {"transformers", "datasets", "pyarrow"}


class Hide(importlib.abc.MetaPathFinder):  # as if not installed: no module, no distribution
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, Hide())
for attribute in ("distribution", "version"):
    def hidden(name, _real=getattr(metadata, attribute)):
        if name.lower() in HIDDEN:
            raise metadata.PackageNotFoundError(name)
        return _real(name)
    setattr(metadata, attribute, hidden)

import loops_callbacks, loops_callbacks.cli, loops_callbacks.data, loops_callbacks.models
from loops_callbacks.data import DPODataModule

module = DPODataModule([{"chosen": [1, 2, 3], "rejected": [1, 2, 4], "prompt_length": 2}])
assert len(module.dpo_data()) == 2
assert not any(name.split(".")[0] in HIDDEN for name in sys.modules)
for call in (lambda: DPODataModule(path="x.parquet").dpo_data(),
             lambda: DPODataModule([{"prompt": "a", "chosen": "b", "rejected": "c"}], tokenizer="gpt2").dpo_data(),
             lambda: loops_callbacks.models.HFDPOModule("gpt2")):
    try:
        call()
    except ImportError as error:
        print(error)
"""


def test_the_base_install_works_without_the_hf_extra_and_names_it_when_needed(tmp_path: Path) -> None:
    (tmp_path / "x.parquet").write_bytes(b"")
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_THE_HF_EXTRA], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [
        f"reading the Parquet file 'x.parquet' needs the 'pyarrow' package, part of the 'hf' extra: {HF_EXTRA_HINT}",
        f"loading the tokenizer 'gpt2' needs the 'transformers' package, part of the 'hf' extra: {HF_EXTRA_HINT}",
        f"HFDPOModule needs the 'transformers' package, part of the 'hf' extra: {HF_EXTRA_HINT}",
    ]


# ----------------------------------------------------------------------------- the DataModule


def test_chat_pairs_train_with_the_modules_tokenizer_and_tokenize_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import loops_callbacks.data.records_across_ranks as tokenizing  # DPODataModule tokenizes through it

    calls = []
    real = tokenizing.tokenize_records
    monkeypatch.setattr(tokenizing, "tokenize_records", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    data = DPODataModule(path=small_pairs(tmp_path), max_length=128, batch_size=4, val_fraction=0.25, progress=False)
    trainer = fit(tiny_module(), data, tmp_path, val_check_interval=2)
    assert calls == [TOKENIZER]  # the LightningModule's tokenizer
    assert data.tokenization_report.num_pairs == 24 and data.tokenization_report.formats == {"conversational": 24}
    assert all("ref_logprobs" in datum.loss_fn_inputs for datum in data.scored_pairs.datums())
    assert {"train/dpo_loss", "val/dpo_accuracy"} <= set(trainer.callback_metrics)
    # at step 0 the policy is the reference: every reward is 0
    batch = next(iter(data.train_dataloader()))
    loss, metrics = dpo_loss(tiny_module().policy_logprobs(batch), batch["ref_logprobs"], batch["weights"], 0.1)
    assert metrics["dpo_margin"].item() == pytest.approx(0.0, abs=1e-5)
    data.setup("fit")  # a second setup does not tokenize again
    assert len(calls) == 1


def test_changing_the_tokenizer_or_a_limit_rescores_and_the_same_settings_do_not(tmp_path: Path) -> None:
    pairs = small_pairs(tmp_path, 8)
    cache = str(tmp_path / "cache")

    def run(**kwargs: Any) -> DPODataModule:
        data = DPODataModule(path=pairs, cache_dir=cache, batch_size=4, progress=False, **kwargs)
        fit(tiny_module(), data, tmp_path, max_steps=1)
        return data

    assert run().reference_report.source == "scored"
    assert run().reference_report.source == "cache"
    with pytest.warns(ReferenceCacheWarning, match="the data changed"), pytest.warns(PreferenceDataWarning):
        assert run(max_length=30).reference_report.source == "scored"
    other = transformers.AutoTokenizer.from_pretrained(TOKENIZER)
    other.chat_template = other.chat_template.replace("{{ bos_token }}", "")
    with pytest.warns(ReferenceCacheWarning, match="the data changed"):
        changed = run(tokenizer=other)
    assert changed.reference_report.source == "scored"
    assert changed.dpo_data().input_ids[0] != other.bos_token_id


def test_text_needs_a_tokenizer_from_somewhere(tmp_path: Path) -> None:
    data = DPODataModule(path=small_pairs(tmp_path, 2), progress=False)
    with pytest.raises(ValueError, match="line 1 of .*pairs.jsonl: conversational records are text and need a tokenizer"):
        fit(HFDPOModule({**TINY, "vocab_size": 512}), data, tmp_path)


def test_yaml_load_dataset_arguments_and_tokenizer_path(tmp_path: Path) -> None:
    pairs = small_pairs(tmp_path, 6)
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(DPODataModule, "data")
    config = parser.parse_string(
        f"data:\n  dataset: {{path: json, data_files: {pairs}, split: train}}\n  tokenizer: {TOKENIZER}\n"
        "  max_length: 48\n  max_prompt_length: 32\n  progress: false\n"
    )
    module = parser.instantiate(config).data
    assert module.dataset == {"path": "json", "data_files": pairs, "split": "train"}
    with pytest.warns(PreferenceDataWarning, match="2 of 6 pair"):
        from_yaml = [d.model_input.to_ints() for d in module.dpo_data().datums()]
    direct = DPODataModule(path=pairs, tokenizer=TOKENIZER, max_length=48, max_prompt_length=32, progress=False)
    with pytest.warns(PreferenceDataWarning):
        assert from_yaml == [d.model_input.to_ints() for d in direct.dpo_data().datums()]
    assert module.tokenization_report.record_indices == list(range(6))


def test_a_datasets_dataset_in_memory(tmp_path: Path) -> None:
    rows = [
        {"prompt": "Q: colour of snow?\nA:", "chosen": " White.", "rejected": " Purple."},
        {"prompt": "Q: 2 plus 2?\nA:", "chosen": " 4.", "rejected": " 5."},
    ]
    data = DPODataModule(datasets.Dataset.from_list(rows), batch_size=2, progress=False)
    fit(tiny_module(), data, tmp_path, max_steps=1)
    assert data.tokenization_report.formats == {"standard": 2}
    assert data.scored_pairs.datums()[0].model_input.to_ints()[-1] == 3  # the EOS appended to the completion


# ----------------------------------------------------------------------------- the CLI


@pytest.fixture
def in_a_scratch_dir_with_the_shipped_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Runs write under tmp_path; the config's relative data paths resolve to a copy of ``configs/data``."""
    shutil.copytree(CONFIGS / "data", tmp_path / "configs" / "data")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.usefixtures("in_a_scratch_dir_with_the_shipped_data")
def test_the_dpo_hf_config_runs_from_the_cli(capsys: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PreferenceDataWarning)
        cli = run_cli(
            ["fit", "--config", str(CONFIGS / "dpo_hf.yaml"), "--trainer.max_steps", "4",
             "--trainer.val_check_interval", "2", "--trainer.log_every_n_steps", "2"]
        )
    assert isinstance(cli.model, HFDPOModule) and cli.model.vocab_size == 512
    assert cli.datamodule.tokenization_report.num_pairs == 512
    assert {"train/dpo_accuracy", "val/dpo_accuracy"} <= set(cli.trainer.callback_metrics)
    assert len(glob.glob("runs/dpo_hf/wandb/offline-run-*")) == 1
    assert glob.glob("runs/dpo_hf/reference_logprobs/*")  # the cache a rerun loads
    assert "metrics.csv" in capsys.readouterr().out


@pytest.mark.usefixtures("in_a_scratch_dir_with_the_shipped_data")
def test_the_dpo_hf_config_round_trips(tmp_path: Path, capsys: Any) -> None:
    def printed(config: Path) -> str:
        with pytest.raises(SystemExit):
            run_cli(["fit", "--config", str(config), "--print_config"])
        return capsys.readouterr().out

    first = printed(CONFIGS / "dpo_hf.yaml")
    short = yaml.safe_load(first)
    short["model"]["class_path"], short["data"]["class_path"] = "HFDPOModule", "DPODataModule"
    (tmp_path / "short.yaml").write_text(yaml.safe_dump(short))
    assert yaml.safe_load(printed(tmp_path / "short.yaml")) == yaml.safe_load(first)  # short class names work
    (tmp_path / "printed.yaml").write_text(first)
    assert yaml.safe_load(printed(tmp_path / "printed.yaml")) == yaml.safe_load(first)
    model = yaml.safe_load(first)["model"]["init_args"]["model"]
    assert model["config"]["model_type"] == "llama" and model["tokenizer"] == "configs/data/chat_tokenizer"
    assert os.path.isdir(model["tokenizer"])
