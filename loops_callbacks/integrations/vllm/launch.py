"""vLLM servers started on this machine, with the weight routes on: for tests, demos and benchmarks of a fleet."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from loops_callbacks.integrations.vllm.engine import import_vllm
from loops_callbacks.validation import check, check_int, check_real

SERVER_ENVIRONMENT = {
    "VLLM_SERVER_DEV_MODE": "1",  # /pause, /resume, /collective_rpc, /update_weight_version, /weight_checker, ...
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
"""The environment a server of the fleet starts with (a value already set in the environment is kept, but
``VLLM_CPU_KVCACHE_SPACE``, which would override ``--kv-cache-memory-bytes``)."""


def server_command(model_dir: str | os.PathLike[str], port: int, *, dtype: str = "float32",
                   max_model_len: int = 1024, kv_cache_bytes: int = 256 * 2**20,
                   extra_args: Sequence[str] = ()) -> list[str]:
    """The command that starts one vLLM server of a fleet (``vllm serve`` does not start with the CPU build).

    Examples:
        >>> server_command("/models/tiny", 8001)[2:6]
        ['vllm.entrypoints.openai.api_server', '--model', '/models/tiny', '--port']
    """
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--port", str(check_int("port", port, least=1)), "--host", "127.0.0.1", "--dtype", dtype,
            "--max-model-len", str(max_model_len), "--enforce-eager", "--logprobs-mode", "processed_logprobs",
            "--kv-cache-memory-bytes", str(check_int("kv_cache_bytes", kv_cache_bytes, least=1)), *extra_args]


def free_port() -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


class LocalVLLMServers:
    """``count`` vLLM servers on ``model_dir``, each on a free port of 127.0.0.1, started together.

    Each runs ``server_command`` in its own process group, in ``workdir`` (a temporary directory by
    default: nothing is written elsewhere; vLLM's cache and config go there too), with
    ``SERVER_ENVIRONMENT``. ``start`` waits up to ``start_timeout`` seconds for every ``/health``; a
    server that exits first is a ``RuntimeError`` with the end of its log. ``stop`` (or leaving the
    ``with`` block) ends each process group, killed if it does not stop in 30 s. ``urls``: the servers.

    A fleet on two local servers::

        with LocalVLLMServers("/models/tiny", count=2) as servers:
            fleet = VLLMServerFleet(servers.urls)
    """

    def __init__(self, model_dir: str | os.PathLike[str], *, count: int = 2, dtype: str = "float32",
                 max_model_len: int = 1024, kv_cache_bytes: int = 256 * 2**20, extra_args: Sequence[str] = (),
                 environment: Mapping[str, str] | None = None,
                 workdir: str | os.PathLike[str] | None = None, start_timeout: float = 300.0) -> None:
        self.model_dir = Path(check("model_dir", model_dir, (str, os.PathLike), "a checkpoint directory"))
        self.count = check_int("count", count, least=1)
        self.dtype, self.max_model_len, self.extra_args = dtype, max_model_len, list(extra_args)
        self.kv_cache_bytes = kv_cache_bytes
        self.environment = dict(environment or {})
        self.workdir = None if workdir is None else Path(workdir)
        self.start_timeout = check_real("start_timeout", start_timeout, least=1.0, what="seconds")
        self.urls: list[str] = []
        self.processes: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []
        self._environment: dict[str, str] = {}
        self._own_workdir: tempfile.TemporaryDirectory[str] | None = None

    def start(self) -> list[str]:
        """Start the servers and wait until each answers ``/health``; returns their URLs."""
        import_vllm("LocalVLLMServers")
        if self.workdir is None:
            self._own_workdir = tempfile.TemporaryDirectory(prefix="vllm_servers_")
            self.workdir = Path(self._own_workdir.name)
        self.workdir.mkdir(parents=True, exist_ok=True)
        base = {key: value for key, value in os.environ.items()
                if key not in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE")}
        environment = {**{k: v for k, v in SERVER_ENVIRONMENT.items()}, **base, **self.environment}
        environment.update(VLLM_SERVER_DEV_MODE="1")
        environment.pop("VLLM_CPU_KVCACHE_SPACE", None)
        environment.setdefault("VLLM_CACHE_ROOT", str(self.workdir / "vllm_cache"))
        environment.setdefault("VLLM_CONFIG_ROOT", str(self.workdir / "vllm_config"))
        self._environment = environment
        try:
            for index in range(self.count):
                port = free_port()
                self.urls.append(f"http://127.0.0.1:{port}")
                self.logs.append(self.workdir / f"server{index}_{port}.log")
                self.processes.append(self._launch(index))
            self._wait(range(self.count))
        except BaseException:
            self.stop()
            raise
        return list(self.urls)

    def _launch(self, index: int) -> subprocess.Popen[bytes]:
        port = int(self.urls[index].rsplit(":", 1)[1])
        assert self.workdir is not None
        with open(self.logs[index], "ab") as log:
            return subprocess.Popen(
                server_command(self.model_dir, port, dtype=self.dtype, max_model_len=self.max_model_len,
                               kv_cache_bytes=self.kv_cache_bytes, extra_args=self.extra_args),
                stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir, env=self._environment, start_new_session=True,
            )

    def restart(self, index: int) -> None:
        """Kill server ``index`` and start it again on the same port (its weights: the checkpoint, version
        ``"default"``), waiting for its ``/health``."""
        self.kill(index)
        self.processes[index] = self._launch(index)
        self._wait([index])

    def _wait(self, indices: Any) -> None:
        deadline = time.monotonic() + self.start_timeout
        waiting = set(indices)
        while waiting:
            for index in sorted(waiting):
                process = self.processes[index]
                if process.poll() is not None:
                    raise RuntimeError(f"the vLLM server {self.urls[index]} exited ({process.returncode}) before "
                                       f"answering /health: {self.log_tail(index)}")
                if _healthy(self.urls[index]):
                    waiting.discard(index)
            if waiting and time.monotonic() > deadline:
                names = ", ".join(self.urls[i] for i in sorted(waiting))
                raise TimeoutError(f"the vLLM servers {names} did not answer /health within {self.start_timeout:g} s")
            if waiting:
                time.sleep(0.5)

    def log_tail(self, index: int, characters: int = 3000) -> str:
        """The end of server ``index``'s log."""
        return self.logs[index].read_text(errors="replace")[-characters:]

    def kill(self, index: int) -> None:
        """Kill server ``index`` now (its process group), as a crash would."""
        self._end(self.processes[index], signal.SIGKILL)

    def stop(self) -> None:
        """Stop every server (its whole process group); idempotent."""
        for process in self.processes:
            self._end(process, signal.SIGTERM)
        self.processes, self.urls = [], []
        if self._own_workdir is not None:
            self._own_workdir.cleanup()
            self._own_workdir, self.workdir = None, None

    @staticmethod
    def _end(process: subprocess.Popen[bytes], first: signal.Signals) -> None:
        if process.poll() is not None:
            return
        try:
            os.killpg(process.pid, first)
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
        except ProcessLookupError:
            pass

    def __enter__(self) -> LocalVLLMServers:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
