"""What the tests share: a tiny policy, generated Datum batches, metric comparisons, ranks as threads.

``TinyPolicy``'s sampler logprobs differ from its trainer logprobs by a known amount, and every
micro-batch it trains on is recorded, so tests can recompute the monitor's numbers with
``loops_compute_kl_sample_train`` on exactly the same tokens. ``rows`` generates batches with every
awkward value (None, NaN, -inf, masked-out, zero advantages); ``as_datums`` turns them into each
accepted input form. ``reduce_in_threads`` runs the cross-rank reduction with threads as ranks.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import multiprocessing
import multiprocessing.util
import os
import runpy
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
import types
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from hypothesis import strategies as st
from lightning.pytorch.loggers.logger import Logger
from torch import nn
from torch.utils.data import DataLoader, Dataset

from loops_callbacks import loops_compute_kl_sample_train
from loops_callbacks.divergence.batch import flatten_datums
from loops_callbacks.divergence.statistics import reduce_across_ranks
from loops_callbacks.divergence.statistics import DivergenceStats, StatisticsOptions
from loops_callbacks.types import Datum, ModelInput, TensorData
from tests.oracle import PREFIX as P

VOCAB, LENGTH = 16, 12


class TokenDataset(Dataset):
    """Item i: a deterministic token row, an action mask, sampler noise and an advantage."""

    def __init__(self, size: int = 64) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(index)
        tokens = torch.randint(0, VOCAB, (LENGTH + 1,), generator=generator)
        mask = (torch.arange(LENGTH) >= 3 + index % 4).float()
        return {
            "input_ids": tokens[:-1],
            "target_tokens": tokens[1:],
            "mask": mask,
            "noise": 0.1 * torch.randn(LENGTH, generator=generator),
            "advantages": torch.tensor(float(index % 3 - 1) if index % 5 else 0.5),
        }


class TinyPolicy(pl.LightningModule):
    """Trainer logprobs from a tiny LM; sampler logprobs = trainer + noise + ``offset``."""

    def __init__(self, offset: float = 0.0, lr: float = 0.05, manual: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB)
        self.offset = offset
        self.lr = lr
        self.automatic_optimization = not manual
        self.recorded: list[dict[str, Any]] = []

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        logits = self(batch["input_ids"]).float()
        logprobs = torch.log_softmax(logits, -1).gather(-1, batch["target_tokens"][..., None]).squeeze(-1)
        sampler = logprobs.detach().float() + batch["noise"] + self.offset
        loss = -(logprobs * batch["mask"] * batch["advantages"][:, None]).sum() / batch["mask"].sum()
        if not self.automatic_optimization:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
        self.recorded.append(
            {
                "step": self.trainer.fit_loop.epoch_loop._batches_that_stepped,
                "sampler": sampler.double().cpu(),
                "trainer": logprobs.detach().double().cpu(),
                "mask": batch["mask"].cpu(),
                "advantages": batch["advantages"].cpu(),
                "input_ids": batch["input_ids"].cpu(),
                "target_tokens": batch["target_tokens"].cpu(),
            }
        )
        return {"loss": loss, "training_logprobs": logprobs, "logprobs": sampler}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TokenDataset(), batch_size=4, shuffle=False)


class RecordingLogger(Logger):
    """Keeps every ``log_metrics`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, dict[str, Any]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self.calls.append((step, dict(metrics)))


def datums_of(records: list[dict[str, Any]]) -> tuple[list[Datum], list[torch.Tensor]]:
    """The recorded micro-batches as Loops datums (concatenated in order) and trainer rows."""
    datums, trainer = [], []
    for record in records:
        for row in range(record["sampler"].shape[0]):
            datums.append(
                Datum(
                    ModelInput.from_ints(record["input_ids"][row].tolist()),
                    {
                        "logprobs": record["sampler"][row],
                        "mask": record["mask"][row],
                        "advantages": record["advantages"][row : row + 1],
                        "target_tokens": record["target_tokens"][row],
                    },
                )
            )
            trainer.append(record["trainer"][row])
    return datums, trainer


def expected_metrics(records: list[dict[str, Any]]) -> dict[str, float]:
    return loops_compute_kl_sample_train(*datums_of(records))


def quiet_trainer(**kwargs: Any) -> pl.Trainer:
    defaults: dict[str, Any] = dict(
        accelerator="cpu", devices=1, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, logger=False, log_every_n_steps=1,
    )
    defaults.update(kwargs)
    return pl.Trainer(**defaults)


def _destroy_process_group() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


class CleanDistributedExit(pl.Callback):
    """Destroys the process group when a spawned rank exits.

    Lightning destroys it in an ``atexit`` handler, which ``ddp_spawn`` workers never run (they
    leave through ``os._exit``); a gloo group left alive can abort the worker at exit.
    """

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.world_size > 1 and multiprocessing.parent_process() is not None:
            multiprocessing.util.Finalize(None, _destroy_process_group, exitpriority=100)


# --- Datum batches in every input form, generated ------------------------------------------

EXACT_KEYS = {  # order statistics and counts: no summation, so bit-for-bit
    "diff_abs_p50", "diff_abs_p90", "diff_abs_p99", "diff_abs_max", "frac_abs_gt_1", "frac_abs_gt_2",
    "frac_abs_gt_4", "n_action_tokens", "is_ratio_max", "is_ratio_min",
    "frac_is_ratio_gt_2", "frac_is_ratio_lt_0.5", "frac_abs_gt_0.5", "n_sequences", "n_skipped_nonfinite",
}


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The logged metric scalars, without the breakdown (the diagnosis' and the strata's, tested on their own)."""
    return {k: v for k, v in metrics.items() if isinstance(v, float) and k.removeprefix(P).count("/") == 0}


def assert_metrics_equal(got: dict[str, Any], want: dict[str, float]) -> None:
    scalars = {k: v for k, v in got.items() if isinstance(v, float)}
    assert scalars.keys() == want.keys()
    for key, value in want.items():
        if key.removeprefix(P) in EXACT_KEYS:
            assert scalars[key] == value, key
        else:
            assert scalars[key] == pytest.approx(value, rel=1e-11, abs=1e-12), key


logprob = st.one_of(
    st.floats(-30, 0, allow_nan=False), st.just(0.0), st.none(), st.just(math.nan), st.just(-math.inf)
)


@st.composite
def rows(draw: Any, max_datums: int = 6, max_len: int = 12) -> list[dict[str, Any]]:
    out = []
    for _ in range(draw(st.integers(0, max_datums))):
        n = draw(st.integers(0, max_len))
        row: dict[str, Any] = {
            "tokens": draw(st.lists(st.integers(0, 50), min_size=n, max_size=n)),
            "logprobs": [None] + draw(st.lists(logprob, min_size=n, max_size=n))[1:] if n else [],
            "mask": draw(st.lists(st.sampled_from([0.0, 1.0, 1.0, 1.0, 0.5]), min_size=n, max_size=n)),
        }
        row["trainer"] = [
            None if s is None else (s + draw(st.floats(-5, 5)) if math.isfinite(s) else s)
            for s in row["logprobs"]
        ]
        row["trainer"] = [draw(st.sampled_from([t, t, t, None, math.inf])) for t in row["trainer"]]
        kind = draw(st.sampled_from(["none", "per_token", "one"]))
        if kind == "per_token":
            row["advantages"] = draw(st.lists(st.sampled_from([0.0, 1.5, -0.5, None]), min_size=n, max_size=n))
        elif kind == "one":
            row["advantages"] = [draw(st.sampled_from([0.0, 2.0, -1.0]))]
        if draw(st.booleans()):
            row["target_tokens"] = draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
        out.append(row)
    return out


def _nan(values: list[Any]) -> list[float]:
    return [math.nan if v is None else float(v) for v in values]


def rounded(rows_: list[dict[str, Any]], dtype: torch.dtype) -> list[dict[str, Any]]:
    """The same rows as they read after a round trip through ``dtype`` (None becomes NaN)."""
    out = []
    for row in rows_:
        row = dict(row)
        for key in ("logprobs", "trainer"):
            row[key] = torch.tensor(_nan(row[key]), dtype=dtype).double().tolist()
        out.append(row)
    return out


def as_datums(rows_: list[dict[str, Any]], form: str) -> tuple[list[Any], list[Any]]:
    """Datums and trainer rows in one input form."""
    datums, trainer = [], []
    for row in rows_:
        fields = {k: row[k] for k in ("logprobs", "mask", "advantages", "target_tokens") if k in row}
        if form == "lists":
            inputs, t = fields, row["trainer"]
        elif form == "tensor_data":
            inputs = {
                k: TensorData(v, "int64" if k == "target_tokens" else "float32", [len(v)]) for k, v in fields.items()
            }
            t = TensorData(row["trainer"], "float32", [len(row["trainer"])])
        elif form == "numpy":
            inputs = {k: np.array(_nan(v)) for k, v in fields.items()}
            t = np.array(_nan(row["trainer"]), dtype=np.float32)
        else:  # torch tensors of one dtype
            dtype = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}[form]
            inputs = {k: torch.tensor(_nan(v), dtype=dtype) for k, v in fields.items()}
            if "target_tokens" in row:
                inputs["target_tokens"] = torch.tensor(row["target_tokens"])
            t = torch.tensor(_nan(row["trainer"]), dtype=dtype)
        datums.append(Datum(ModelInput.from_ints(row["tokens"]), inputs))
        trainer.append(t)
    return datums, trainer


# --- statistics of parts, and "ranks" as threads ----------------------------------------------

def stats_of(
    batch: list[dict[str, Any]], top_n: int, sample_size: int | None = None, seed: int = 1
) -> DivergenceStats:
    datums, trainer = as_datums(batch, "lists")
    return DivergenceStats.from_batch(
        flatten_datums(datums, trainer, with_tokens=True), StatisticsOptions(top_n=top_n, sample_size=sample_size),
        generator=torch.Generator().manual_seed(seed),
    )


def assert_totals_equal(got: Any, want: Any) -> None:
    """Every total (the diagnosis' sums included) and the per-token-id sums: counts exact, sums to float64 order."""
    for name, value in want.totals.items():
        assert got.totals[name] == pytest.approx(value, rel=1e-12, abs=1e-12), name
    np.testing.assert_allclose(got.token_sums, want.token_sums, rtol=1e-12, atol=1e-12)


class ThreadGroup:
    """'Ranks' as threads, with ``torch.distributed``'s semantics for the two collectives."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.slots: list[torch.Tensor | None] = [None] * world
        self.barrier = threading.Barrier(world)

    def for_rank(self, rank: int) -> ThreadCollectives:
        return ThreadCollectives(self, rank)

    def exchange(self, rank: int, tensor: torch.Tensor) -> torch.Tensor:
        self.slots[rank] = tensor.clone()
        self.barrier.wait()
        stacked = torch.stack(self.slots)  # every rank's tensor, in rank order
        self.barrier.wait()
        return stacked


class ThreadCollectives:
    """One thread's view of a ``ThreadGroup``: a process group as ``reduce_across_ranks`` uses it."""

    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.rank, self.world_size = group, rank, group.world

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.group.exchange(self.rank, tensor)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.group.exchange(self.rank, tensor).sum(0)


def reduce_in_threads(parts: list[DivergenceStats], seed: int = 0) -> list[DivergenceStats]:
    """Every 'rank''s result of ``reduce_across_ranks`` on ``parts`` (part r on rank r)."""
    group, results = ThreadGroup(len(parts)), [None] * len(parts)

    def run(rank: int) -> None:
        generator = torch.Generator().manual_seed(seed + rank)
        results[rank] = reduce_across_ranks(parts[rank], group.for_rank(rank), generator=generator)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(parts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert all(result is not None for result in results)
    return results


# --- a DPO policy ----------------------------------------------------------------------------

class ToyDPO(pl.LightningModule):
    """Embedding + linear: ``forward(input_ids)`` returns logits; a DPO loss on the collated batch."""

    def __init__(self, vocab: int = 16, dim: int = 8, lr: float = 0.5, beta: float = 0.5) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)
        self.lr = lr
        self.beta = beta

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        # whole pairs, also under a DistributedSampler: rows 2i and 2i + 1 share their prompt
        assert batch["input_ids"].shape[0] % 2 == 0
        assert torch.equal(batch["input_ids"][0::2, :2], batch["input_ids"][1::2, :2])
        logprobs = self(batch["input_ids"]).log_softmax(-1)
        logprobs = logprobs.gather(-1, batch["target_tokens"].unsqueeze(-1)).squeeze(-1)
        delta = ((logprobs - batch["ref_logprobs"]) * batch["weights"]).sum(-1)
        return -F.logsigmoid(self.beta * (delta[0::2] - delta[1::2])).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def free_port() -> int:
    """A free TCP port on the loopback interface, for a test's own process group."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


PRELOADED = ["torch", "lightning.pytorch", "loops_callbacks", "tests.helpers"]
"""What the ranks' fork server imports once: a spawned rank spends about 7 s importing them, a forked one 0.04 s."""


def start_two_ranks(worker: Callable[..., None], args: tuple[Any, ...], *, join: bool) -> Any:
    """``worker(rank, *args)`` in two processes (``torch.multiprocessing.start_processes``), forked from one
    server per test process that has imported ``PRELOADED`` (``multiprocessing``'s forkserver). A rank gets this
    process's ``sys.path`` and working directory, and the environment it had when the server started (after the
    session's fixtures set theirs): a rank sets its own ``RANK`` and ``MASTER_PORT``, as each worker here does."""
    multiprocessing.set_forkserver_preload(PRELOADED)  # read when the server starts, the first time
    return mp.start_processes(worker, args=args, nprocs=2, join=join, start_method="forkserver")


def run_two_ranks(
    worker: Callable[..., None], args: tuple[Any, ...], out_dir: Path, what: str, seconds: float = 120
) -> list[Any]:
    """Run ``worker(rank, *args)`` in two processes (``start_two_ranks``) and load what each saved as
    ``out_dir/rank<r>.pt``.

    A rank still running after ``seconds`` fails the test (``what`` says which case hung) instead
    of hanging the suite.
    """
    context = start_two_ranks(worker, args, join=False)
    for _ in range(int(2 * seconds)):
        if context.join(timeout=0.5):
            break
    else:
        for process in context.processes:
            process.terminate()
        pytest.fail(f"the ranks hung: {what}")
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]


@dataclass
class ForkedPython:
    """``python *args`` run by a process forked from the preloaded server (``start_python``)."""

    args: list[str]
    process: Any  # a multiprocessing.Process
    outputs: tempfile.TemporaryDirectory[str]
    stderr_to_stdout: bool

    def wait(self, timeout: float) -> subprocess.CompletedProcess[str]:
        """Its exit status and outputs, as ``subprocess.run(..., capture_output=True, text=True)`` gives them;
        ``subprocess.TimeoutExpired`` (the process killed) if it runs past ``timeout`` seconds."""
        self.process.join(timeout)
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join()
            raise subprocess.TimeoutExpired(self.args, timeout, output=self._read("stdout"))
        stderr = None if self.stderr_to_stdout else self._read("stderr")
        done = subprocess.CompletedProcess(self.args, self.process.exitcode, self._read("stdout"), stderr)
        self.outputs.cleanup()
        return done

    def kill(self) -> None:
        if self.process.exitcode is None:
            self.process.kill()

    def _read(self, name: str) -> str:
        return Path(self.outputs.name, name).read_text(errors="replace")


def start_python(
    *args: str, cwd: str | Path | None = None, env: dict[str, str] | None = None, stderr_to_stdout: bool = False
) -> ForkedPython:
    """Start ``python *args`` (a script and its arguments, ``-c CODE ...`` or ``-m MODULE ...``) as a process
    forked from the server that has imported ``PRELOADED``: 0.04 s to start instead of about 7 s.

    It runs in ``cwd`` with exactly ``env`` (default: this process's environment), its ``sys.argv`` and
    ``sys.path[0]`` as Python sets them, ``OMP_NUM_THREADS`` applied to torch, its outputs in files, and the
    ``atexit`` handlers run at its end. Unlike a fresh process, it has the preloaded modules imported
    already (so an environment variable they read at import has no effect) and the server's hash seed:
    what depends on those (imports, memory, ``PYTHONHASHSEED``) needs ``subprocess``.
    """
    multiprocessing.set_forkserver_preload(PRELOADED)
    outputs = tempfile.TemporaryDirectory(prefix="python-")
    stderr = "stdout" if stderr_to_stdout else "stderr"
    for name in {"stdout", stderr}:
        Path(outputs.name, name).touch()
    target_args = (list(args), str(cwd or os.getcwd()), dict(os.environ if env is None else env), outputs.name, stderr)
    process = multiprocessing.get_context("forkserver").Process(target=_as_python, args=target_args)
    process.start()
    return ForkedPython(list(args), process, outputs, stderr_to_stdout)


def run_python(*args: str, timeout: float = 300, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``start_python(*args, **kwargs).wait(timeout)``."""
    return start_python(*args, **kwargs).wait(timeout)


def _as_python(args: list[str], cwd: str, env: dict[str, str], outputs: str, stderr: str) -> None:
    """The forked process: what ``python *args`` does, from the point where the imports are done."""
    for fd, name in ((1, "stdout"), (2, stderr)):
        file = os.open(os.path.join(outputs, name), os.O_WRONLY | os.O_APPEND)
        os.dup2(file, fd)
        os.close(file)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # TMPDIR is read again
    if "OMP_NUM_THREADS" in env:
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    try:
        if args[0] == "-c":
            sys.argv, sys.path[0:0] = ["-c", *args[2:]], [""]
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(args[1], "<string>", "exec"), main.__dict__)
        elif args[0] == "-m":
            sys.argv, sys.path[0:0] = [args[1], *args[2:]], [cwd]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv, sys.path[0:0] = list(args), [os.path.dirname(os.path.abspath(args[0]))]
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit:
        raise  # multiprocessing turns its code into the exit status, as Python does
    except BaseException:
        traceback.print_exc()  # as Python prints it, without multiprocessing's header
        raise SystemExit(1) from None
    finally:
        atexit._run_exitfuncs()


def selected_in_this_module(request: pytest.FixtureRequest) -> list[pytest.Item]:
    """The session's selected tests that belong to the requesting fixture's module."""
    return [item for item in request.session.items if getattr(item, "module", None) is request.module]


@contextlib.contextmanager
def in_background(runs: Mapping[str, Callable[[], Any]], at_once: int = 2) -> Iterator[dict[str, Future[Any]]]:
    """Each of ``runs`` started in order, ``at_once`` at a time (the cores of the smallest machine the suite runs
    on), while the tests go on: its future by name. Those not started yet are cancelled at the end."""
    with ThreadPoolExecutor(max_workers=at_once) as pool:
        yield {name: pool.submit(run) for name, run in runs.items()}
        pool.shutdown(cancel_futures=True)


class WarningsDuringFit(pl.Callback):
    """Records every warning a rank gives during fit; ``said(trainer)`` at its end gets the messages."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._catching = warnings.catch_warnings(record=True)
        self._caught = self._catching.__enter__()
        warnings.simplefilter("always")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._catching.__exit__(None, None, None)
        self.said(trainer, [str(w.message) for w in self._caught])

    def said(self, trainer: pl.Trainer, messages: list[str]) -> None:
        raise NotImplementedError
