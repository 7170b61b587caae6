"""A fleet of vLLM servers as the sampler: weights pushed to every server in parallel, each server's version
known, rollouts spread over the servers and tagged with the server and the version that sampled them."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch import nn

from loops_callbacks import run_warnings
from loops_callbacks.divergence.batch import SamplerFacts
from loops_callbacks.integrations.vllm.engine import VLLMWarning
from loops_callbacks.integrations.vllm.rollouts import _padded_batch, prompt_token_ids
from loops_callbacks.integrations.vllm.server import (
    ServerHTTPError,
    completion_rows,
    completions_request,
    server_json,
)
from loops_callbacks.integrations.vllm.weight_sync import checkpoint_weights
from loops_callbacks.optional import import_optional
from loops_callbacks.validation import check, check_bool, check_choice, check_int, check_real

PACKED_MODULES: dict[str, tuple[str, ...]] = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                                              "gate_up_proj": ("gate_proj", "up_proj")}
"""vLLM's fused parameters of Llama-style models (its ``packed_modules_mapping``): the checkpoint's shards,
concatenated along dim 0 in this order, are the engine's one parameter."""

SYNC_PHASES = ("pause", "transfer", "cache", "version", "resume")
"""A sync's phases on each server, in order (``cache``: the prefix-cache reset, 0 with ``cache_salt``)."""

_EMPTY_DIGEST = hashlib.sha256(b"").hexdigest()  # what /weight_checker says of a parameter whose bytes a kernel holds
_DEV_MODE_HINT = ("the server has no weight routes: start it with VLLM_SERVER_DEV_MODE=1 in its environment "
                  "(vLLM registers /pause, /resume, /collective_rpc, /update_weight_version, /weight_info and "
                  "/weight_checker only in dev mode)")


class VLLMServerError(RuntimeError):
    """A server of the fleet failed in a phase: ``server`` (its URL), ``phase`` (``connect``, ``check``, a
    ``SYNC_PHASES`` one, ``verify``, ``version check``, ``rollouts``) and what happened."""

    def __init__(self, server: str, phase: str, detail: str) -> None:
        super().__init__(f"vLLM server {server}, phase {phase!r}: {detail}")
        self.server, self.phase, self.detail = server, phase, detail


@dataclasses.dataclass
class ServerState:
    """What the fleet knows of one server: the version it set (``None``: never synced, the server's
    ``"default"``), its settings read from ``/server_info``, its parameter names (``/weight_checker``), and
    whether a sync failed part way on it (``weights_unknown``: its rollouts are refused until a sync succeeds)."""

    url: str
    model: str = ""
    dtype: str = ""
    logprobs_mode: str = ""
    prefix_caching: bool = True
    parameters: tuple[str, ...] = ()
    version: int | None = None
    weights_unknown: bool = False


@dataclasses.dataclass
class SyncReport:
    """One sync: the ``version`` set, ``write_seconds`` (the trainer writing the weights, path transport),
    ``phases`` (per server, seconds per ``SYNC_PHASES`` phase, plus ``verify`` when verified), ``seconds`` the
    whole sync, ``servers`` those synced, ``dropped`` those that left the fleet in it (URL: why),
    ``unverified`` parameters ``/weight_checker`` cannot read on the servers (a kernel holds their bytes)."""

    version: int
    write_seconds: float = 0.0
    phases: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    servers: list[str] = dataclasses.field(default_factory=list)
    dropped: dict[str, str] = dataclasses.field(default_factory=dict)
    unverified: list[str] = dataclasses.field(default_factory=list)

    def slowest(self) -> dict[str, float]:
        """Per phase, the slowest server's seconds (the phases run on all servers at once)."""
        names = [*SYNC_PHASES, "verify"]
        return {name: max((p[name] for p in self.phases.values() if name in p), default=0.0) for name in names
                if any(name in p for p in self.phases.values())}


def engine_parameter_name(name: str, packed: Mapping[str, Sequence[str]] = PACKED_MODULES) -> str:
    """The engine parameter a checkpoint weight loads into (``...q_proj.weight`` -> ``...qkv_proj.weight``).

    Examples:
        >>> engine_parameter_name("model.layers.0.mlp.up_proj.weight")
        'model.layers.0.mlp.gate_up_proj.weight'
    """
    parts = name.split(".")
    for fused, shards in packed.items():
        for shard in shards:
            if shard in parts[:-1]:
                parts[parts.index(shard)] = fused
                return ".".join(parts)
    return name


def engine_digests(weights: Mapping[str, torch.Tensor], packed: Mapping[str, Sequence[str]] = PACKED_MODULES,
                   ) -> dict[str, str]:
    """SHA-256 of each engine parameter as vLLM's ``/weight_checker`` computes it (one tensor-parallel rank),
    from the checkpoint ``weights`` as sent: a fused parameter is its shards concatenated in ``packed`` order.

    Examples:
        >>> digests = engine_digests({"norm.weight": torch.ones(2)})
        >>> digests["norm.weight"] == hashlib.sha256(torch.ones(2).numpy().tobytes()).hexdigest()
        True
    """
    grouped: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for name, tensor in weights.items():
        engine = engine_parameter_name(name, packed)
        order = 0
        if engine != name:
            fused = next(f for f in packed if f"{f}." in engine or engine.endswith(f".{f}"))
            shard = next(s for s in packed[fused] if f".{s}." in f".{name}.")
            order = list(packed[fused]).index(shard)
        grouped.setdefault(engine, []).append((order, tensor))
    digests = {}
    for engine, parts in grouped.items():
        tensors = [t.detach().cpu().contiguous() for _, t in sorted(parts, key=lambda part: part[0])]
        whole = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)
        digests[engine] = hashlib.sha256(whole.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
    return digests


def _server_version(text: Any) -> int | None:
    """A server's ``weight_version`` as the int the fleet set (``None``: ``"default"``, never set)."""
    if text == "default":
        return None
    if isinstance(text, str) and text.isascii() and text.isdigit() and len(text) < 19:
        return int(text)
    return -1  # a version the fleet did not set


def _rank() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class VLLMServerFleet:
    """N vLLM servers (started with ``VLLM_SERVER_DEV_MODE=1``) as one sampler: syncs and rollouts.

    Args:
        urls: the servers, ``http://host:port`` each (at least one, no repeats).
        weights_dir: where the path transport writes the weights, a directory every server can read
            (a shared filesystem across machines); a temporary directory of this machine by default.
        transport: ``"path"`` (safetensors written to ``weights_dir``, then each server's
            ``/collective_rpc reload_weights`` loads them in place: any device) or ``"nccl"`` (vLLM's
            ``WeightTransferTrainerFactory`` NCCL engine, servers started with ``--weight-transfer-config
            '{"backend": "nccl"}'``; CUDA only: its rendezvous is this machine's ``nccl_address`` and a
            free port per server, or ``nccl_init(url)``'s ``NCCLTrainerInitInfo``; untested here, no GPU).
        prefix_cache: ``"reset"``: each sync resets each server's prefix cache (``/reset_prefix_cache``,
            preempting requests in flight, which then recompute their KV with the new weights); ``"salt"``:
            no reset, every later request carries ``cache_salt`` = the server's version, so no request
            is served KV computed with other weights (older blocks stay until evicted: memory, not a wait).
        verify: after each sync, compare each server's ``/weight_checker`` checksums with the other
            servers' and with what was sent; a mismatch is an error naming the server and the parameter.
        on_server_error: ``"raise"`` (a ``VLLMServerError`` naming the server and the phase) or
            ``"drop"`` (that server leaves the fleet with one ``VLLMWarning``; the run goes on with the
            others; none left is an error).
        timeout: seconds for each call to a server (a sync's transfer, a rollouts request).
        prefix: where the model's weights are in the module pushed (``checkpoint_weights``).
        packed_modules: the servers' fused parameters (``PACKED_MODULES``, vLLM's Llama-style ones).
        max_in_flight: requests in flight per server during ``rollouts``.
        prompts_per_request: prompts in one ``/v1/completions`` request.

    ``push(module)`` is called on every rank (DDP, FSDP): the global rank 0 gathers the weights once and
    talks to the servers, and every rank learns the outcome (the version, the servers left). Each server
    is paused (``mode=keep``: requests in flight wait), loaded, its prefix cache reset (or not, with
    ``"salt"``), its weight version set (``/update_weight_version``) and resumed, all servers in parallel;
    ``last_sync`` times each phase. ``rollouts(prompts, ...)`` reads each server's version before and after
    sampling: a server whose version is not the one the fleet set (restarted, or synced by another) is an
    error naming it, never a silently stale rollout. Each row carries ``sampler_server`` (the URL) and
    ``policy_version`` (the version the server reported)::

        fleet = VLLMServerFleet(["http://node1:8000", "http://node2:8000"], weights_dir="/shared/weights")
        fleet.push(pl_module)  # every rank, e.g. in on_train_batch_start; version = trainer.global_step
        batch = fleet.rollouts(prompts, max_tokens=256, n=8, stop_token_ids=[eos_id])
    """

    def __init__(
        self, urls: Sequence[str], *, weights_dir: str | os.PathLike[str] | None = None, transport: str = "path",
        prefix_cache: str = "reset", verify: bool = False, on_server_error: str = "raise", timeout: float = 120.0,
        prefix: str | None = None, packed_modules: Mapping[str, Sequence[str]] = PACKED_MODULES,
        max_in_flight: int = 4, prompts_per_request: int = 8, nccl_address: str = "127.0.0.1",
        nccl_init: Callable[[str], Any] | None = None,
    ) -> None:
        check("urls", urls, (list, tuple), "a list of server URLs (http://host:port)")
        if not urls:
            raise ValueError("urls is empty: a fleet needs at least one vLLM server")
        cleaned = []
        for index, url in enumerate(urls):
            check(f"urls[{index}]", url, str, "a server's http://host:port", lambda u: u.startswith(("http://", "https://")))
            cleaned.append(url.rstrip("/"))
        repeated = sorted({url for url in cleaned if cleaned.count(url) > 1})
        if repeated:
            raise ValueError(f"urls names {repeated[0]} {cleaned.count(repeated[0])} times; each server once")
        self.transport = check_choice("transport", transport, ("path", "nccl"))
        self.prefix_cache = check_choice("prefix_cache", prefix_cache, ("reset", "salt"))
        self.verify = check_bool("verify", verify)
        self.on_server_error = check_choice("on_server_error", on_server_error, ("raise", "drop"))
        self.timeout = float(check_real("timeout", timeout, least=1e-3, what="seconds"))
        self.prefix = check("prefix", prefix, str, "a str such as 'policy.'", optional=True)
        self.packed_modules = {str(k): tuple(v) for k, v in packed_modules.items()}
        self.max_in_flight = check_int("max_in_flight", max_in_flight, least=1)
        self.prompts_per_request = check_int("prompts_per_request", prompts_per_request, least=1)
        self._own_dir: tempfile.TemporaryDirectory[str] | None = None
        if weights_dir is None:
            self._own_dir = tempfile.TemporaryDirectory(prefix="vllm_fleet_weights_")
            weights_dir = self._own_dir.name
        self.weights_dir = os.fspath(check("weights_dir", weights_dir, (str, os.PathLike), "a directory"))
        self.servers: dict[str, ServerState] = {url: ServerState(url) for url in cleaned}
        self.dropped: dict[str, str] = {}
        self.version: int | None = None
        self.last_sync: SyncReport | None = None
        self.nccl_address = check("nccl_address", nccl_address, str, "the trainer's address the servers reach")
        self.nccl_init = nccl_init
        self._nccl_engines: dict[str, Any] = {}
        self._connected = False
        self._written: str | None = None

    # ---- faults -----------------------------------------------------------------------------------

    def _error(self, url: str, phase: str, error: BaseException) -> VLLMServerError:
        if isinstance(error, VLLMServerError):
            return error
        if isinstance(error, ServerHTTPError) and error.status == 404:
            return VLLMServerError(url, phase, f"{error.endpoint} answered 404 Not Found: {_DEV_MODE_HINT}")
        if isinstance(error, TimeoutError):
            return VLLMServerError(url, phase, f"timed out ({error})")
        if isinstance(error, ConnectionError):
            return VLLMServerError(url, phase, f"unreachable ({error})")
        return VLLMServerError(url, phase, f"{type(error).__name__}: {str(error)[:1500]}")

    def _fail(self, url: str, phase: str, error: BaseException) -> None:
        """``on_server_error="raise"``: raise it, naming the server and phase; ``"drop"``: the server leaves."""
        fault = self._error(url, phase, error)
        if self.on_server_error == "raise":
            raise fault
        self._drop(url, str(fault))

    def _drop(self, url: str, why: str) -> None:
        if url not in self.servers:
            return
        del self.servers[url]
        self.dropped[url] = why
        run_warnings.warn(f"{why}; the server leaves the fleet (on_server_error='drop'), {len(self.servers)} left",
                          VLLMWarning)
        if not self.servers:
            raise RuntimeError(f"no vLLM server is left in the fleet: {'; '.join(self.dropped.values())}")

    def _call(self, url: str, path: str, body: Mapping[str, Any] | None = None, *, method: str = "POST",
              timeout: float | None = None) -> dict[str, Any]:
        return server_json(url, path, body, method=method, timeout=timeout or self.timeout)

    def _parallel(self, work: Callable[[str], Any], urls: Sequence[str]) -> dict[str, Any]:
        """``work(url)`` on each server at once; per server its result or the exception it raised."""
        results: dict[str, Any] = {}
        if len(urls) == 1:
            try:
                results[urls[0]] = work(urls[0])
            except Exception as error:  # noqa: BLE001 - handed back per server
                results[urls[0]] = error
            return results
        with ThreadPoolExecutor(max_workers=len(urls)) as pool:
            futures = {url: pool.submit(work, url) for url in urls}
        for url, future in futures.items():
            error = future.exception()
            results[url] = error if error is not None else future.result()
        return results

    # ---- connecting -------------------------------------------------------------------------------

    def connect(self) -> None:
        """Read each server's settings, parameter names and version; refuse a fleet whose servers serve
        different models, dtypes or logprobs modes (the error names both servers). Done by the first sync
        or rollouts; again for a server found restarted."""
        answers = self._parallel(self._read_server, list(self.servers))
        for url, answer in answers.items():
            if isinstance(answer, BaseException):
                self._fail(url, "connect", answer)
        self._check_alike()
        self._connected = True

    def _read_server(self, url: str) -> None:
        state = self.servers[url]
        info = self._call(url, "/server_info?config_format=json", method="GET")
        model = info.get("vllm_config", {}).get("model_config", {})
        state.model = str(model.get("model", ""))
        state.dtype = str(model.get("dtype", "")).removeprefix("torch.")
        state.logprobs_mode = str(model.get("logprobs_mode", ""))
        state.prefix_caching = bool(info.get("vllm_config", {}).get("cache_config", {}).get("enable_prefix_caching"))
        checksums = self._call(url, "/weight_checker", {"action": "checksum"}).get("checksums", {})
        state.parameters = tuple(sorted({name.rsplit(":", 1)[-1] for name in checksums}))
        reported = self._call(url, "/weight_info", method="GET").get("weight_version")
        if self.version is not None and _server_version(reported) != state.version:
            raise VLLMServerError(url, "connect", self._version_gap(state, reported))
        if self.version is None:
            known = _server_version(reported)
            state.version = None if known is None else known

    def _check_alike(self) -> None:
        states = list(self.servers.values())
        if not states:
            return
        first = states[0]
        for state in states[1:]:
            for field in ("parameters", "dtype", "logprobs_mode"):
                if getattr(state, field) != getattr(first, field):
                    mine, theirs = getattr(state, field), getattr(first, field)
                    if field == "parameters":
                        extra = sorted(set(mine) - set(theirs))[:3]
                        lacking = sorted(set(theirs) - set(mine))[:3]
                        said = f"has parameters {extra} that {first.url} does not, and lacks {lacking}"
                    else:
                        said = f"has {field} {mine!r}, {first.url} {theirs!r}"
                    self._fail(state.url, "connect", VLLMServerError(
                        state.url, "connect", f"serves another model than {first.url} ({state.model!r} vs "
                        f"{first.model!r}): it {said}"))
                    break
        if any(state.logprobs_mode.endswith("_logits") for state in self.servers.values()):
            url = next(s.url for s in self.servers.values() if s.logprobs_mode.endswith("_logits"))
            raise VLLMServerError(url, "connect", "the server reports logits, not logprobs: start it with "
                                  "--logprobs-mode processed_logprobs")

    def _version_gap(self, state: ServerState, reported: Any) -> str:
        expected = "its start-up checkpoint ('default')" if state.version is None else f"{state.version}"
        cause = " (restarted since: it serves the checkpoint it was started from)" if reported == "default" else \
            " (synced by someone else?)"
        return (f"reports weight version {reported!r} but the fleet set {expected}{cause}; its rollouts would be "
                "stale: sync it again (push) before sampling from it")

    # ---- the sync ---------------------------------------------------------------------------------

    def push(self, module: nn.Module, *, version: int | None = None, servers: Sequence[str] | None = None) -> int:
        """Push ``module``'s weights (a LightningModule's, an ``nn.Module``'s, a Hugging Face model's) to the
        servers (``servers``: a subset, by URL; all by default), call on every rank; returns the version.

        ``version``: by default the trainer's ``global_step`` of a LightningModule attached to one, else one
        more than the last. Errors name the server and the phase; ``last_sync`` is the report."""
        check_int("version (the trainer's optimizer steps of these weights)", version, least=0, optional=True)
        if version is None:
            trainer = getattr(module, "_trainer", None)
            version = trainer.global_step if trainer is not None else (self.version or 0) + 1
        rank, world = _rank()
        weights = self._gathered(module, sender=rank == 0)
        outcome: dict[str, Any]
        if rank == 0:
            try:
                report = self._sync(weights, version, servers)
                outcome = {"report": report, "states": self.servers, "dropped": self.dropped, "error": None}
            except Exception as error:  # every rank raises it, not only this one
                outcome = {"report": None, "states": self.servers, "dropped": self.dropped, "error": error}
        else:
            outcome = {}
        del weights
        if world > 1:
            import torch.distributed as dist

            box = [outcome]
            dist.broadcast_object_list(box, src=0)
            outcome = box[0]
        self.servers, self.dropped = outcome["states"], outcome["dropped"]
        self._connected = True
        if outcome["error"] is not None:
            raise outcome["error"]
        self.last_sync = outcome["report"]
        self.version = version
        return version

    def _gathered(self, module: nn.Module, *, sender: bool) -> dict[str, torch.Tensor]:
        """The checkpoint's weights, full (an FSDP2 ``DTensor`` gathered: every rank takes part), on the sender
        only (``{}`` elsewhere)."""
        weights = checkpoint_weights(module, prefix=self.prefix)
        full: dict[str, torch.Tensor] = {}
        for name, tensor in weights.items():
            if hasattr(tensor, "full_tensor"):  # a DTensor: a collective every rank joins
                tensor = tensor.full_tensor()
            if sender:
                full[name] = tensor
        return full

    def _sync(self, weights: dict[str, torch.Tensor], version: int, subset: Sequence[str] | None) -> SyncReport:
        start = time.perf_counter()
        meta = [name for name, tensor in weights.items() if tensor.is_meta]
        if meta:
            raise ValueError(f"{meta[0]!r} (and {len(meta) - 1} more) is on the meta device: it holds no values to push")
        if not self._connected:
            self.connect()
        urls = list(self.servers) if subset is None else [self._known(url) for url in subset]
        report = SyncReport(version=version, servers=[])
        dropped_before = dict(self.dropped)
        first = next(iter(self.servers.values()))
        dtype = getattr(torch, first.dtype or "float32", None)
        known = set(first.parameters)
        tied = {name for name, partner in _tied_copies(weights).items()  # lm_head tied to the embeddings: vLLM has
                if known and engine_parameter_name(name, self.packed_modules) not in known  # one parameter for both
                and engine_parameter_name(partner, self.packed_modules) in known}
        sent = {name: tensor.detach().to(dtype) if tensor.is_floating_point() and isinstance(dtype, torch.dtype)
                else tensor.detach() for name, tensor in weights.items() if name not in tied}
        for url in list(urls):
            try:
                self._check_names(url, sent)
            except Exception as error:  # noqa: BLE001
                self._fail(url, "check", error)
                urls.remove(url)
        if not urls:
            raise RuntimeError("no vLLM server to sync: " + "; ".join(self.dropped.values()))
        if self.transport == "path":
            written = time.perf_counter()
            path = self._write(sent, version)
            report.write_seconds = time.perf_counter() - written
            transfer: Callable[[str], None] = lambda url: self._reload(url, path)  # noqa: E731
        else:
            transfer = lambda url: self._nccl_send(url, sent)  # noqa: E731
        answers = self._parallel(lambda url: self._sync_one(url, transfer, version), urls)
        for url, answer in answers.items():
            if isinstance(answer, BaseException):
                self._fail(url, getattr(answer, "phase", "transfer"), answer)
            else:
                report.phases[url] = answer
                report.servers.append(url)
        if self.verify and report.servers:
            self._verify(report, sent)
        if self.transport == "path" and self._written is not None and self._written != path:
            shutil.rmtree(self._written, ignore_errors=True)  # the last version's files: no server reads them now
        if self.transport == "path":
            self._written = path
        report.dropped = {url: why for url, why in self.dropped.items() if url not in dropped_before}
        report.seconds = time.perf_counter() - start
        return report

    def _known(self, url: str) -> str:
        url = check("servers[...]", url, str, "a server URL of the fleet").rstrip("/")
        if url not in self.servers:
            raise ValueError(f"{url} is not a server of the fleet (servers: {list(self.servers)})")
        return url

    def _check_names(self, url: str, sent: Mapping[str, torch.Tensor]) -> None:
        """A ``VLLMServerError`` (phase ``check``) naming the weights the server has no parameter for, and the
        parameters no weight reaches (the server would keep them as they were, silently)."""
        known = set(self.servers[url].parameters)
        if not known:
            return
        reached = {name: engine_parameter_name(name, self.packed_modules) for name in sent}
        unknown = sorted(name for name, engine in reached.items() if engine not in known)
        if unknown:
            raise VLLMServerError(url, "check", f"the server has no parameter for {len(unknown)} of the "
                                  f"{len(sent)} weights sent: {unknown[:5]}{' ...' if len(unknown) > 5 else ''} "
                                  f"(its own: {sorted(known)[:3]} ...); another model, or pass prefix=")
        missing = sorted(known - set(reached.values()))
        if missing:
            raise VLLMServerError(url, "check", f"no weight sent reaches {len(missing)} of the server's parameters, "
                                  f"which would keep their old values: {missing[:5]}"
                                  f"{' ...' if len(missing) > 5 else ''}")

    def _write(self, sent: Mapping[str, torch.Tensor], version: int) -> str:
        """The weights as one safetensors file under ``weights_dir/version-N`` (written aside, then renamed)."""
        safetensors = import_optional("safetensors.torch", "VLLMServerFleet's path transport")
        os.makedirs(self.weights_dir, exist_ok=True)
        final = os.path.join(os.path.abspath(self.weights_dir), f"version-{version}")
        staging = tempfile.mkdtemp(prefix=f".version-{version}-", dir=self.weights_dir)
        tensors = {name: tensor.cpu().contiguous().clone() if _shares_storage(tensor, sent) else tensor.cpu().contiguous()
                   for name, tensor in sent.items()}
        safetensors.save_file(tensors, os.path.join(staging, "model.safetensors"))
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(staging, final)
        return final

    def _reload(self, url: str, path: str) -> None:
        answer = self._call(url, "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}})
        if "results" not in answer and answer:
            raise RuntimeError(f"/collective_rpc answered {str(answer)[:300]}")

    def _nccl_send(self, url: str, sent: Mapping[str, torch.Tensor]) -> None:
        engine = self._nccl_engines.get(url)
        if engine is None:
            init = self.nccl_init or (lambda server: nccl_rendezvous(server, self.nccl_address, self.timeout))
            engine = self._nccl_engines[url] = nccl_trainer_engine(url, sent, init, timeout=self.timeout)
        engine.source.weights = sent
        engine.send_weights()

    def _sync_one(self, url: str, transfer: Callable[[str], None], version: int) -> dict[str, float]:
        state = self.servers[url]
        phases: dict[str, float] = {}
        phase = "pause"

        def timed(name: str, action: Callable[[], Any]) -> None:
            nonlocal phase
            phase = name
            began = time.perf_counter()
            action()
            phases[name] = time.perf_counter() - began

        try:
            # keep: requests in flight wait; clear_cache=false: vLLM 0.32 would reset the prefix cache here, before
            # the load (the reset that counts comes after it, or the requests' salt changes)
            timed("pause", lambda: self._call(url, "/pause?mode=keep&clear_cache=false"))
            state.weights_unknown = True
            timed("transfer", lambda: transfer(url))
            if self.prefix_cache == "reset":
                timed("cache", lambda: self._reset_cache(url))
            else:
                phases["cache"] = 0.0
            timed("version", lambda: self._call(url, "/update_weight_version", {"new_version": str(version)}))
            state.version, state.weights_unknown = version, False
            timed("resume", lambda: self._call(url, "/resume"))
        except Exception as error:
            fault = self._error(url, phase, error)
            if phase != "resume":
                try:  # requests kept in flight must not wait for ever; the server's weights are unknown now
                    self._call(url, "/resume", timeout=min(self.timeout, 10.0))
                except Exception:  # noqa: BLE001 - the phase's own error is the one to raise
                    pass
            if state.weights_unknown:
                restart = " (vLLM leaves a reload that failed part way half done: restart the server)" \
                    if phase == "transfer" else ""
                fault = VLLMServerError(url, phase, fault.detail + "; its weights are unknown until a sync succeeds "
                                        f"(its rollouts are refused until then){restart}")
            raise fault from error
        return phases

    def _reset_cache(self, url: str) -> None:
        answer = self._call(url, "/reset_prefix_cache?reset_running_requests=true")
        if answer.get("success") is False:
            raise RuntimeError("the server did not reset its prefix cache (success: false)")

    def _verify(self, report: SyncReport, sent: Mapping[str, torch.Tensor]) -> None:
        """Each synced server's ``/weight_checker`` checksums against what was sent and against the others'."""
        began: dict[str, float] = {}

        def checksums(url: str) -> dict[str, str]:
            began[url] = time.perf_counter()
            answer = self._call(url, "/weight_checker", {"action": "checksum"}).get("checksums", {})
            return {name.rsplit(":", 1)[-1]: digest for name, digest in answer.items()}

        answers = self._parallel(checksums, list(report.servers))
        expected = engine_digests(sent, self.packed_modules)
        reference: tuple[str, dict[str, str]] | None = None
        unreadable: set[str] = set()
        for url, answer in answers.items():
            if isinstance(answer, BaseException):
                self._fail(url, "verify", answer)
                report.servers.remove(url)
                continue
            report.phases[url]["verify"] = time.perf_counter() - began[url]
            wrong = sorted(name for name, digest in answer.items()
                           if digest != _EMPTY_DIGEST and name in expected and digest != expected[name])
            unreadable |= {name for name, digest in answer.items() if digest == _EMPTY_DIGEST}
            if not wrong and reference is not None:
                other_url, other = reference
                wrong = sorted(name for name in answer.keys() | other.keys() if answer.get(name) != other.get(name))
                if wrong:
                    self._verify_failed(report, url, f"its checksums differ from {other_url}'s for {wrong[:5]}")
                    continue
            if wrong:
                self._verify_failed(report, url, f"its weights differ from those sent for {len(wrong)} parameters: "
                                    f"{wrong[:5]}{' ...' if len(wrong) > 5 else ''}")
                continue
            reference = reference or (url, answer)
        report.unverified = sorted(unreadable)

    def _verify_failed(self, report: SyncReport, url: str, said: str) -> None:
        self.servers[url].weights_unknown = True
        report.servers.remove(url)
        self._fail(url, "verify", VLLMServerError(url, "verify", said))

    # ---- rollouts ---------------------------------------------------------------------------------

    def check_versions(self, urls: Sequence[str] | None = None) -> dict[str, int]:
        """Each server's ``/weight_info``, which must be the version the fleet set (a restarted server
        reports ``"default"``): a ``VLLMServerError`` (phase ``version check``) or a drop otherwise.
        Returns each server's version (0: the start-up checkpoint, never synced)."""
        if not self._connected:
            self.connect()
        urls = list(self.servers) if urls is None else [url for url in urls if url in self.servers]
        answers = self._parallel(lambda url: self._call(url, "/weight_info", method="GET"), urls)
        versions = {}
        for url, answer in answers.items():
            state = self.servers[url]
            if isinstance(answer, BaseException):
                self._fail(url, "version check", answer)
                continue
            reported = answer.get("weight_version")
            if _server_version(reported) != state.version:
                self._fail(url, "version check", VLLMServerError(url, "version check", self._version_gap(state, reported)))
                continue
            if state.weights_unknown:
                self._fail(url, "version check", VLLMServerError(
                    url, "version check", "a sync failed part way on it: its weights are unknown until a sync succeeds"))
                continue
            versions[url] = state.version or 0
        return versions

    def facts(self, url: str, request: Mapping[str, Any]) -> SamplerFacts:
        """Server ``url``'s ``SamplerFacts`` sampling with ``request`` (its dtype, logprobs mode and version)."""
        state = self.servers[url]
        return SamplerFacts(
            engine="vllm", dtype=state.dtype or None, logprobs_mode=state.logprobs_mode or None,
            temperature=request.get("temperature"), top_p=request.get("top_p"), top_k=request.get("top_k"),
            weight_version=state.version or 0, stale_prefix_cache=False if state.prefix_caching else None,
            weights_unknown=state.weights_unknown,
        )

    def rollouts(
        self, prompts: Sequence[Any], *, max_tokens: int, n: int = 1, temperature: float = 1.0, top_p: float = 1.0,
        top_k: int = -1, stop_token_ids: Sequence[int] | None = None, tokenizer: Any = None, pad_id: int = 0,
        groups: Sequence[int] | None = None, device: str | torch.device | None = None, **options: Any,
    ) -> dict[str, Any]:
        """``n`` completions of each prompt, the prompts spread over the servers (``max_in_flight`` requests
        of ``prompts_per_request`` prompts per server at once: a faster server takes more), as the monitor's
        batch (``completions_batch``'s keys) with, per row, ``sampler_server`` (the server's URL, a list of
        str), ``policy_version`` (the version that server reported, before and after sampling), and
        ``sampler_facts_by_server`` (URL: ``SamplerFacts``); ``sampler_facts`` holds what all share
        (``weight_version`` the lowest). Rows are prompt-major in the order of ``prompts``.

        A server that fails (unreachable, a time-out, an error status) or whose version is not the one the
        fleet set is a ``VLLMServerError`` naming it, or with ``on_server_error="drop"`` leaves the fleet
        and its prompts go to the others."""
        ids = prompt_token_ids(prompts, tokenizer)
        template = completions_request(ids[:1], max_tokens=max_tokens, n=n, temperature=temperature, top_p=top_p,
                                       top_k=top_k, stop_token_ids=stop_token_ids, **options)
        if "cache_salt" in options and self.prefix_cache == "salt":
            raise ValueError("cache_salt is set by the fleet (prefix_cache='salt': the server's version)")
        chunks = [list(range(start, min(start + self.prompts_per_request, len(ids))))
                  for start in range(0, len(ids), self.prompts_per_request)]
        done: dict[int, tuple[str, Any]] = {}
        while len(done) < len(chunks):
            versions = self.check_versions()
            pending = [index for index in range(len(chunks)) if index not in done]
            answered, failed = self._sample(pending, chunks, ids, template, list(versions))
            for url, (phase, error) in failed.items():
                if isinstance(error, ServerHTTPError) and error.status in (400, 422):  # the request's fault, not its
                    raise ValueError(f"vLLM server {url} refused the rollouts request: {error}") from None
                self._fail(url, phase, error)
            after = self.check_versions(sorted({url for url, _ in answered.values()}))
            for index, (url, result) in answered.items():
                if url in after and after[url] == versions[url]:
                    done[index] = (url, result)
        return self._batch(chunks, done, ids, template, pad_id, groups, device)

    def _sample(self, pending: list[int], chunks: list[list[int]], ids: list[list[int]], template: Mapping[str, Any],
                urls: list[str]) -> tuple[dict[int, tuple[str, Any]], dict[str, tuple[str, BaseException]]]:
        work: queue.Queue[int] = queue.Queue()
        for index in pending:
            work.put(index)
        answered: dict[int, tuple[str, Any]] = {}
        failed: dict[str, tuple[str, BaseException]] = {}
        lock = threading.Lock()

        def serve(url: str) -> None:
            while True:
                with lock:
                    if url in failed:
                        return
                try:
                    index = work.get_nowait()
                except queue.Empty:
                    return
                request = {**template, "prompt": [ids[i] for i in chunks[index]]}
                if self.prefix_cache == "salt":
                    request["cache_salt"] = f"v{self.servers[url].version or 0}"
                try:
                    response = self._call(url, "/v1/completions", request)
                    rows = completion_rows(request, response)
                except Exception as error:  # noqa: BLE001 - the chunk goes back; the server is named
                    work.put(index)
                    with lock:
                        failed.setdefault(url, ("rollouts", error))
                    return
                with lock:
                    answered[index] = (url, (request, rows))

        workers = [url for _ in range(self.max_in_flight) for url in urls]  # interleaved: each starts at once
        with ThreadPoolExecutor(max_workers=len(workers)) as pool:
            for future in [pool.submit(serve, url) for url in workers]:
                future.result()
        return answered, failed

    def _batch(self, chunks: list[list[int]], done: Mapping[int, tuple[str, Any]], ids: list[list[int]],
               template: Mapping[str, Any], pad_id: int, groups: Sequence[int] | None,
               device: str | torch.device | None) -> dict[str, Any]:
        prompts: list[np.ndarray] = []
        completions: list[np.ndarray] = []
        logprobs: list[np.ndarray] = []
        counts: list[int] = []
        servers: list[str] = []
        versions: list[int] = []
        by_server: dict[str, SamplerFacts] = {}
        for index in range(len(chunks)):
            url, (request, (rows, tokens, values, per_prompt)) = done[index]
            prompts += rows
            completions += tokens
            logprobs += values
            counts += per_prompt
            servers += [url] * len(rows)
            versions += [self.servers[url].version or 0] * len(rows) if url in self.servers else [0] * len(rows)
            if url in self.servers:
                by_server[url] = self.facts(url, request)
        shared = _shared_facts(list(by_server.values()))
        batch = _padded_batch(prompts, completions, logprobs, counts, shared, None, groups, pad_id, device)
        batch["policy_version"] = torch.tensor(versions, dtype=torch.int64, device=batch["input_ids"].device)
        batch["sampler_server"] = servers
        batch["sampler_facts_by_server"] = by_server
        return batch

    def close(self) -> None:
        """Remove the weights this fleet wrote (its own temporary directory too) and shut NCCL engines down."""
        for engine in self._nccl_engines.values():
            engine.shutdown()
        self._nccl_engines.clear()
        if self._written is not None:
            shutil.rmtree(self._written, ignore_errors=True)
            self._written = None
        if self._own_dir is not None:
            self._own_dir.cleanup()
            self._own_dir = None


def _tied_copies(weights: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Each weight that is another's tensor (tied: the same storage, offset and shape), and that other one."""
    first: dict[tuple[int, int, tuple[int, ...]], str] = {}
    copies = {}
    for name, tensor in weights.items():
        if tensor.is_meta:
            continue
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in first:
            copies[name] = first[key]
        else:
            first[key] = name
    return copies


def _shares_storage(tensor: torch.Tensor, weights: Mapping[str, torch.Tensor]) -> bool:
    """Whether another of ``weights`` shares ``tensor``'s storage (tied weights: safetensors refuses them)."""
    pointer = tensor.untyped_storage().data_ptr()
    return sum(t.untyped_storage().data_ptr() == pointer for t in weights.values()) > 1


def _shared_facts(facts: list[SamplerFacts]) -> SamplerFacts | None:
    """What every server's facts say alike (a field they differ on: ``None``); ``weight_version`` the lowest,
    ``stale_prefix_cache`` and ``weights_unknown`` true if any is."""
    if not facts:
        return None
    fields = {}
    for field in SamplerFacts._fields:
        values = {getattr(f, field) for f in facts}
        fields[field] = values.pop() if len(values) == 1 else None
    fields["weight_version"] = min(f.weight_version or 0 for f in facts)
    stale = [f.stale_prefix_cache for f in facts]
    fields["stale_prefix_cache"] = True if any(stale) else (None if None in stale else False)
    fields["weights_unknown"] = any(f.weights_unknown for f in facts)
    fields["engine"] = fields["engine"] or "vllm"
    return SamplerFacts(**fields)


class _CheckpointSource:
    """vLLM's ``WeightSource`` over the checkpoint's weights as sent (the NCCL transport's source)."""

    def __init__(self, weights: Mapping[str, torch.Tensor]) -> None:
        self.weights = weights

    def metadata(self) -> list[Any]:
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.weights.items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.weights.items())


def nccl_rendezvous(url: str, address: str, timeout: float) -> Any:
    """vLLM's ``NCCLTrainerInitInfo`` for the server at ``url``: the trainer (rank 0) at ``address`` on a free port,
    the group the trainer and the server's workers (its ``/get_world_size``, data parallel aside)."""
    from loops_callbacks.integrations.vllm.launch import free_port

    nccl = import_optional("vllm.distributed.weight_transfer.nccl_engine", "transport='nccl'")
    workers = server_json(url, "/get_world_size?include_dp=false", method="GET", timeout=timeout)["world_size"]
    return nccl.NCCLTrainerInitInfo(master_address=address, master_port=free_port(), world_size=1 + int(workers),
                                    rank=0)


def nccl_trainer_engine(url: str, weights: Mapping[str, torch.Tensor], init: Callable[[str], Any], *,
                        timeout: float) -> Any:
    """vLLM's trainer-side NCCL engine (``WeightTransferTrainerFactory``) for the server at ``url``, its
    rendezvous from ``init(url)`` (an ``NCCLTrainerInitInfo``: ``master_address``, ``master_port``,
    ``world_size`` = 1 + the server's workers, ``rank=0``). CUDA only."""
    if not torch.cuda.is_available():
        raise RuntimeError("transport='nccl' needs CUDA on the trainer; use transport='path' here")
    base = import_optional("vllm.distributed.weight_transfer.base", "transport='nccl'")
    factory = import_optional("vllm.distributed.weight_transfer.factory", "transport='nccl'")
    clients = import_optional("vllm.distributed.weight_transfer.clients", "transport='nccl'")

    class Source(_CheckpointSource, base.WeightSource):  # type: ignore[misc, name-defined]
        pass

    return factory.WeightTransferTrainerFactory.trainer_init(
        init(url), client=clients.HTTPVLLMWeightSyncClient(url, timeout=timeout), source=Source(weights))


__all__ = ["VLLMServerError", "VLLMServerFleet", "SyncReport", "engine_digests", "engine_parameter_name"]
