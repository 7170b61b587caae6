"""The monitor's cross-rank reduction on 2, 4 and 8 gloo processes, and a cost model for 1,024 ranks.

Two schemes, on the same statistics (monitor defaults: ``top_n=20``, ``sample_size=100_000``):

* current: every rank gathers every rank's totals, extrema, worst rows and full padded sample
  (values and keys: five all-gathers), then merges the parts one by one (the scheme
  ``DivergenceStats.all_gather`` used, kept here as ``gather_everything``);
* new: ``reduction.reduce_across_ranks``: an all-gather of a small header per rank and one
  all-reduce of a fixed body (see ``loops_callbacks/divergence/statistics.py``).

Part 1 runs both on W gloo processes on the CPU (small tensors: ranks hold uneven numbers of
tokens, the last rank none), checks that every rank's result equals the single-process
statistics of the union (counts, extrema and worst rows exactly, sums to float64 order, every
diff in rank order under the cap; a small cap checks each rank's share of the sample) and that
all ranks end bit-for-bit identical, then reports per logged step and rank:

* collectives, and bytes received and sent as counted from the buffers (ring algorithms:
  all-gather (W-1) x part, all-reduce 2 (W-1)/W x buffer);
* bytes received and sent as measured by the kernel on the process's TCP sockets (gloo's own
  traffic, framing included; ``TCP_INFO`` byte counters before and after);
* the wall time of the reduction (the slowest rank; median over repeats).

Part 2 is the cost model. Local compute is measured in one process that plays one rank of W
(the collectives return W copies of its buffers), for W up to 1,024 and 1M or 16M action tokens per
step (N / W per rank); communication is ``latency units x latency + bytes received / bandwidth``.
On part 1's runs the units are ring steps (gloo's algorithms: W - 1 per all-gather, 2 (W - 1) per
all-reduce) and both constants are fitted (loopback, cores time-shared by all ranks); the
extrapolation to 64, 256 and 1,024 ranks takes the issue's 10 us per collective and 100 GB/s, and
shows the network time with 10 us per ring step too (a plain ring all-gather has W - 1 steps).

    python benchmarks/bench_distributed.py                 # 2, 4, 8 processes; the model table
    python benchmarks/bench_distributed.py --quick         # 2 and 4 processes, fewer repeats
    python benchmarks/bench_distributed.py --worlds 8      # the 8-process check only (and the model)
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from loops_callbacks.divergence.batch import flatten_padded  # noqa: E402
from loops_callbacks.distributed import ProcessGroup  # noqa: E402
from loops_callbacks.divergence.statistics import (  # noqa: E402
    message_sizes,
    received_bytes,
    reduce_across_ranks,
)
from loops_callbacks.divergence.statistics import ROW  # noqa: E402
from loops_callbacks.divergence.batch import DEFAULT_MAX_GROUPS  # noqa: E402
from loops_callbacks.divergence.statistics import DivergenceStats, StatisticsOptions, layout_of  # noqa: E402

TOP_N, SAMPLE_SIZE, LENGTH = 20, 100_000, 64
LATENCY_S, BANDWIDTH_BPS = 10e-6, 100e9  # the network: 10 us per collective, 100 GB/s
BYTES = 8


# --- the two schemes ----------------------------------------------------------------------------


def gather_everything(stats: DivergenceStats, collectives: Any) -> DivergenceStats:
    """The current scheme: gather every rank's statistics, merge them in rank order (a loop over W)."""
    gather = collectives.all_gather
    length = stats.sample.shape[0]
    size = stats.sample_size
    if size is None:
        size = int(gather(torch.tensor([length], device=stats.sums.device)).max())
    keys = stats.sample_keys if stats.sample_keys is not None else torch.zeros_like(stats.sample)
    values = torch.nn.functional.pad(stats.sample, (0, size - length))
    keys = torch.nn.functional.pad(keys, (0, size - length), value=float("inf"))
    parts = zip(gather(stats.sums), gather(stats.maxima), gather(stats.worst), gather(values), gather(keys))
    merged: DivergenceStats | None = None
    for sums, maxima, worst, part_values, part_keys in parts:
        part = DivergenceStats(sums, maxima, worst, part_values, part_keys, stats.layout, stats.sample_size)
        merged = part if merged is None else merged.merge(part)
    assert merged is not None
    return merged


def reduce_new(stats: DivergenceStats, collectives: Any) -> DivergenceStats:
    return reduce_across_ranks(stats, collectives, generator=torch.Generator().manual_seed(7))


SCHEMES: dict[str, Callable[[DivergenceStats, Any], DivergenceStats]] = {
    "current": gather_everything,
    "new": reduce_new,
}


def current_received_bytes(world: int, top_n: int = TOP_N, sample_size: int = SAMPLE_SIZE) -> int:
    """Bytes one rank receives in the current scheme: (W - 1) copies of every part."""
    sizes = layout_of().sizes
    return BYTES * (world - 1) * (sizes["sum"] + sizes["max"] + top_n * ROW.WIDTH + 2 * sample_size)


MODEL = {  # scheme: (collectives per logged step, bytes received per rank as a function of W)
    "current": (5, current_received_bytes),
    "new": (2, lambda world: received_bytes(world, TOP_N, SAMPLE_SIZE, layout_of())),
}


class CountingCollectives:
    """Runs another process group's two collectives and counts each call and its ring-algorithm traffic."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.rank, self.world_size = inner.rank, inner.world_size
        self.calls: list[str] = []
        self.received = self.sent = 0.0

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        part = tensor.numel() * tensor.element_size()
        self._count("all_gather", (self.world_size - 1) * part)
        return self.inner.all_gather(tensor)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        size = tensor.numel() * tensor.element_size()
        self._count("all_reduce_sum", 2 * (self.world_size - 1) / self.world_size * size)
        return self.inner.all_reduce_sum(tensor)

    def _count(self, kind: str, traffic: float) -> None:
        self.calls.append(kind)
        self.received += traffic  # ring algorithms: each rank receives what it sends
        self.sent += traffic


class MirrorCollectives:
    """One process playing rank ``rank`` of ``world``: every rank holds the same buffers."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world_size = rank, world

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.expand(self.world_size, *tensor.shape)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


# --- data ---------------------------------------------------------------------------------------


def rank_batch(rank: int, world: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s padded batch: 3 + 2r rows, its own mask rate; the last rank masks everything out."""
    generator = torch.Generator().manual_seed(100 + rank)
    rows = 3 + 2 * rank
    sampler = -torch.rand(rows, LENGTH, generator=generator, dtype=torch.float64) * 4
    mask_rate = 0.0 if rank == world - 1 else 0.3 + 0.6 * rank / world
    tokens = torch.randint(0, 1000, (rows, LENGTH + 1), generator=generator)
    return {
        "sampler_logprobs": sampler,
        "training_logprobs": sampler + 0.2 * torch.randn(rows, LENGTH, generator=generator, dtype=torch.float64),
        "mask": (torch.rand(rows, LENGTH, generator=generator) < mask_rate).double(),
        "input_ids": tokens[:, :-1],
        "target_tokens": tokens[:, 1:],
    }


def stats_of(batch: dict[str, torch.Tensor], sample_size: int, seed: int) -> DivergenceStats:
    flat = flatten_padded(**batch, with_tokens=True)
    return DivergenceStats.from_batch(
        flat, StatisticsOptions(top_n=TOP_N, sample_size=sample_size), generator=torch.Generator().manual_seed(seed)
    )


def union_stats(world: int) -> DivergenceStats:
    batches = [rank_batch(rank, world) for rank in range(world)]
    union = {key: torch.cat([batch[key] for batch in batches]) for key in batches[0]}
    return stats_of(union, SAMPLE_SIZE, seed=0)


# --- part 1: gloo processes ---------------------------------------------------------------------


def tcp_counters() -> dict[str, tuple[int, int]]:
    """Bytes sent and received so far on each TCP socket of this process (Linux ``TCP_INFO``)."""
    counters = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
            if not link.startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
                info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 232)
                if len(info) >= 208:  # tcpi_bytes_received at 128, tcpi_bytes_sent at 200
                    counters[link] = (struct.unpack_from("Q", info, 200)[0], struct.unpack_from("Q", info, 128)[0])
        except OSError:
            pass
        finally:
            sock.close()
    return counters


def tcp_delta(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> tuple[int, int]:
    sent = sum(s - before.get(k, (0, 0))[0] for k, (s, _) in after.items())
    received = sum(r - before.get(k, (0, 0))[1] for k, (_, r) in after.items())
    return sent, received


def check_equal_to_union(result: DivergenceStats, world: int, scheme: str) -> None:
    """Counts, extrema and rows exactly, sums to float64 order, every diff in rank order."""
    got, want = result.to_host(), union_stats(world).to_host()
    for name in want.totals:
        if name.startswith("n_"):
            assert got.totals[name] == want.totals[name], (scheme, name)
        else:
            assert np.isclose(got.totals[name], want.totals[name], rtol=1e-12, atol=1e-12), (scheme, name)
    assert got.extrema == want.extrema, scheme
    assert np.array_equal(got.worst, want.worst), scheme
    assert np.array_equal(got.diffs, want.diffs), scheme


def check_capped_shares(world: int, rank: int, collectives: Any) -> None:
    """With a cap of 50 diffs, each rank gives its proportional share, in rank order."""
    cap = 50
    parts = [stats_of(rank_batch(r, world), cap, seed=r) for r in range(world)]
    result = reduce_across_ranks(parts[rank], collectives, generator=torch.Generator().manual_seed(rank))
    kept = result.to_host().diffs
    counts = np.array([part.to_host().totals["n_action_tokens"] for part in parts])
    assert kept.shape == (cap,)
    source = np.full(cap, -1)
    for r, part in enumerate(parts):
        source[np.isin(kept, part.to_host().diffs)] = r
    assert (source >= 0).all() and (np.diff(source) >= 0).all()  # from some rank, rank 0's first
    shares = np.bincount(source, minlength=world)
    quotas = cap * counts / counts.sum()
    assert ((np.floor(quotas) <= shares) & (shares <= np.ceil(quotas))).all(), (shares, quotas)


def gloo_worker(rank: int, world: int, init_file: str, out_file: str, repeats: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        stats = stats_of(rank_batch(rank, world), SAMPLE_SIZE, seed=rank)
        plain = ProcessGroup()
        barrier_cost = []
        for _ in range(5):  # the trailing barrier's own traffic, subtracted below
            dist.barrier()
            before = tcp_counters()
            dist.barrier()
            barrier_cost.append(tcp_delta(before, tcp_counters()))
        barrier_sent = statistics.median(s for s, _ in barrier_cost)
        barrier_received = statistics.median(r for _, r in barrier_cost)
        rows = {}
        for scheme, run in SCHEMES.items():
            times, sent, received = [], [], []
            for _ in range(repeats):
                counting = CountingCollectives(plain)
                dist.barrier()
                before = tcp_counters()
                start = time.perf_counter()
                result = run(stats, counting)
                times.append(time.perf_counter() - start)
                dist.barrier()
                delta = tcp_delta(before, tcp_counters())
                sent.append(delta[0] - barrier_sent)
                received.append(delta[1] - barrier_received)
            check_equal_to_union(result, world, scheme)
            local = []  # the same work with free collectives, all ranks at once (same contention)
            for _ in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                run(stats, MirrorCollectives(rank, world))
                local.append(time.perf_counter() - start)
            packed = torch.cat([result.sums, result.maxima, result.worst.reshape(-1), result.sample])
            everyone = plain.all_gather(packed)
            assert bool((everyone == packed).all()), f"{scheme}: ranks differ"
            rows[scheme] = {
                "calls": counting.calls,
                "counted_received": counting.received,
                "counted_sent": counting.sent,
                "measured_received": statistics.median(received),
                "measured_sent": statistics.median(sent),
                "seconds": times,
                "local_seconds": statistics.median(local),
            }
        check_capped_shares(world, rank, plain)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, rows)
        if rank == 0:
            torch.save(gathered, out_file)
    finally:
        dist.destroy_process_group()


def run_gloo(world: int, repeats: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.pt")
        mp.spawn(gloo_worker, args=(world, os.path.join(tmp, "store"), out, repeats), nprocs=world)
        return torch.load(out, weights_only=False)


# --- part 2: compute in one process, and the model ----------------------------------------------


def synthetic_rank_stats(tokens: int, seed: int) -> DivergenceStats:
    """A rank's statistics after a step of ``tokens`` action tokens: its sample is min(tokens, cap) long."""
    generator = torch.Generator().manual_seed(seed)
    kept = min(tokens, SAMPLE_SIZE)
    layout = layout_of()
    sums = torch.rand(layout.sizes["sum"], dtype=torch.float64, generator=generator)
    sums[layout.index("n_action_tokens")] = tokens
    sums[layout.index("n_datums")] = max(1, tokens // 512)
    worst = torch.rand(TOP_N, ROW.WIDTH, dtype=torch.float64, generator=generator)
    worst[:, ROW.ABS] = worst[:, ROW.ABS].sort(descending=True).values
    keys = torch.rand(kept, dtype=torch.float64, generator=generator) * kept / max(tokens, 1)
    values = torch.randn(kept, dtype=torch.float64, generator=generator)
    maxima = torch.rand(layout.sizes["max"], dtype=torch.float64, generator=generator)
    return DivergenceStats(sums, maxima, worst, values, keys, layout, SAMPLE_SIZE)


def compute_seconds(scheme: str, world: int, tokens_per_step: int, repeats: int) -> float:
    """Local compute of one rank of ``world`` (collectives free), median of ``repeats``."""
    stats = synthetic_rank_stats(tokens_per_step // world, seed=world)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        SCHEMES[scheme](stats, MirrorCollectives(world // 2, world))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def ring_steps(calls: list[str], world: int) -> int:
    """Sequential hops of the ring algorithms: W - 1 per all-gather, 2 (W - 1) per all-reduce."""
    return sum((world - 1) * (2 if kind == "all_reduce_sum" else 1) for kind in calls)


def fit_network(points: list[tuple[int, float, float]]) -> tuple[float, float]:
    """Non-negative least squares of time = latency units x latency + bytes / bandwidth.

    Returns (latency in s, bandwidth in B/s); a term whose free fit is negative is dropped.
    """
    a = np.array([[units, received] for units, received, _ in points], dtype=np.float64)
    b = np.array([seconds for _, _, seconds in points])
    fits = [np.linalg.lstsq(a, b, rcond=None)[0]]
    for column in (0, 1):  # one term only
        coefficient = float(a[:, column] @ b / (a[:, column] @ a[:, column]))
        fits.append(np.array([coefficient, 0.0] if column == 0 else [0.0, coefficient]))
    feasible = [fit for fit in fits if (fit >= 0).all()]
    latency, per_byte = min(feasible, key=lambda fit: float(np.sum((a @ fit - b) ** 2)))
    return float(latency), (1.0 / per_byte) if per_byte > 0 else float("inf")


def mb(value: float) -> str:
    return f"{value / 1e6:,.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model-worlds", type=int, nargs="+", default=[64, 256, 1024], help="ranks of the cost model")
    parser.add_argument("--model-repeats", type=int, default=3, help="repeats of each cost-model compute time")
    parser.add_argument("--quick", action="store_true", help="2 and 4 processes, 2 repeats, small model sweep")
    args = parser.parse_args()
    if args.quick:
        args.worlds, args.repeats, args.model_worlds, args.model_repeats = [2, 4], 2, [64, 256], 1
    worlds, repeats, model_repeats = args.worlds, args.repeats, args.model_repeats
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs; top_n={TOP_N}, sample_size={SAMPLE_SIZE:,}")

    print("\n## Part 1: gloo processes on this CPU (per logged step, per rank; median of "
          f"{repeats} repeats, time = slowest rank)\n")
    print("| ranks | scheme | collectives | received, counted (MB) | received, measured (MB) "
          "| sent, measured (MB) | time (ms) |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    fit_points = []
    for world in worlds:
        per_rank = run_gloo(world, repeats)
        for scheme in SCHEMES:
            rows = [ranks[scheme] for ranks in per_rank]
            slowest = [max(run) for run in zip(*(row["seconds"] for row in rows))]
            seconds = statistics.median(slowest)
            counted = max(row["counted_received"] for row in rows)
            assert abs(counted - MODEL[scheme][1](world)) < 1, (scheme, world, counted)  # the formula is what ran
            calls = len(rows[0]["calls"])
            print(f"| {world} | {scheme} | {calls} | {mb(counted)} | "
                  f"{mb(max(row['measured_received'] for row in rows))} | "
                  f"{mb(max(row['measured_sent'] for row in rows))} | {seconds * 1e3:.1f} |")
            local = max(row["local_seconds"] for row in rows)
            fit_points.append((ring_steps(rows[0]["calls"], world), counted, max(seconds - local, 0.0)))
        print(f"  checked on {world} ranks: both schemes equal the single-process union (counts, extrema, "
              "rows exactly; sums to 1e-12; every diff in order), all ranks identical, capped shares proportional")

    latency, bandwidth = fit_network(fit_points)
    print(f"\nModel fitted to these runs: time - local compute = ring steps x latency + bytes received / "
          f"bandwidth, with {latency * 1e6:.0f} us per ring step and {bandwidth / 1e9:.3f} GB/s on this loopback "
          f"({os.cpu_count()} cores time-shared by all ranks, so 'latency' is mostly scheduling):")
    for steps, counted, seconds in fit_points:
        modelled = steps * latency + counted / bandwidth
        print(f"  {steps} ring steps, {mb(counted)} MB: measured {seconds * 1e3:.1f} ms, model {modelled * 1e3:.1f} ms")

    print(f"\n## Part 2: cost model at {LATENCY_S * 1e6:.0f} us per collective and {BANDWIDTH_BPS / 1e9:.0f} GB/s "
          "(compute: one rank's share measured on this CPU)\n")
    print("| ranks | tokens/step | scheme | collectives | received per rank (MB) | network (ms) "
          "| compute (ms) | total (ms) | network, 10 us per ring step (ms) |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for world in args.model_worlds:
        for tokens in (1_000_000, 16_000_000):
            for scheme, (calls, received) in MODEL.items():
                network = calls * LATENCY_S + received(world) / BANDWIDTH_BPS
                kinds = ["all_gather"] * calls if scheme == "current" else ["all_gather", "all_reduce_sum"]
                per_step = ring_steps(kinds, world) * LATENCY_S + received(world) / BANDWIDTH_BPS
                local = compute_seconds(scheme, world, tokens, model_repeats)
                print(f"| {world:,} | {tokens / 1e6:.0f}M | {scheme} | {calls} | {mb(received(world))} | "
                      f"{network * 1e3:.2f} | {local * 1e3:.1f} | {(network + local) * 1e3:.1f} | {per_step * 1e3:.1f} |")
    header, body = message_sizes(layout_of(), TOP_N, SAMPLE_SIZE)
    sizes = layout_of().sizes
    print(f"\nBytes received per rank, new scheme: 8 x ((W-1) x {header} + 2 (W-1)/W x {body:,}); current: "
          f"8 x (W-1) x {sizes['sum'] + sizes['max'] + TOP_N * ROW.WIDTH + 2 * SAMPLE_SIZE:,}.")
    bound = received_bytes(1024, TOP_N, SAMPLE_SIZE, layout_of())
    assert bound <= 4_000_000
    print(f"At 1,024 ranks the new scheme receives {mb(bound)} MB per rank (bound: 4 MB).")
    # the runs above read batches without policy versions or groups; the monitor's default keeps the strata too
    default = layout_of(max_groups=DEFAULT_MAX_GROUPS)
    header, body = message_sizes(default, TOP_N, SAMPLE_SIZE)
    print(f"With the monitor's default strata: 8 x ((W-1) x {header} + 2 (W-1)/W x {body:,}); at 1,024 ranks "
          f"{mb(received_bytes(1024, TOP_N, SAMPLE_SIZE, default))} MB per rank.")


if __name__ == "__main__":
    main()
