"""A stalled rank, named three ways: the package's ``StallGuard``, ``torch.distributed.monitored_barrier``, gloo's timeout.

Two gloo ranks on CPU. Rank 1 stalls (sleeps) in a named phase; rank 0 goes to meet it with a
timeout of ``--timeout`` seconds, once through each mechanism, each in a fresh process group:

* ``StallGuard.arrive(phase)``: the meeting the reference scoring uses, through the store;
* ``dist.monitored_barrier(timeout=...)``: torch's own, gloo only;
* a plain ``all_reduce`` in a gloo process group made with ``new_group(timeout=...)``.

It prints, per mechanism and per rank, the seconds to the error, whether the message names the
stalled rank and the phase, and the message itself; then what one meeting costs when no rank
stalls (median of ``--meetings`` meetings, both ranks at the meeting together). Rank 1 notes where
it is (``StallGuard.note``) before it stalls, as the scoring does.

    python benchmarks/bench_stall.py [--timeout 2] [--meetings 200] [--only StallGuard]
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PHASE = "gathering values"
WHERE = "scoring block 3 of 4"
MECHANISMS = ("StallGuard", "monitored_barrier", "gloo timeout")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _meet(mechanism: str, timeout: float, timed_group: dist.ProcessGroup) -> None:
    """One meeting of both ranks before ``PHASE`` through ``mechanism`` (``timed_group``: gloo's own timeout)."""
    from loops_callbacks.distributed import ProcessGroup, StallGuard

    if mechanism == "StallGuard":
        StallGuard(ProcessGroup(), timeout).arrive(PHASE)
    elif mechanism == "monitored_barrier":
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout))
    else:
        dist.all_reduce(torch.zeros(1), group=timed_group)


def _rank(rank: int, port: int, mechanism: str, timeout: float, meetings: int, results: dict) -> None:
    try:
        results[rank] = _stall_or_wait(rank, port, mechanism, timeout, meetings)
    except Exception as error:  # noqa: BLE001 - reported in the table rather than lost in a child process
        results[rank] = (None, f"the benchmark failed before the stall: {type(error).__name__}: {error}", None)
    os._exit(0)  # a timed-out gloo group cannot be destroyed cleanly: the process just ends


def _stall_or_wait(rank: int, port: int, mechanism: str, timeout: float, meetings: int) -> tuple:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # The default group waits long enough for both ranks to start on a loaded machine; the group with the short
    # timeout is made once both have.
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    dist.barrier()
    timed_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
    dist.barrier()
    costs = []
    for _ in range(meetings):
        start = time.perf_counter()
        _meet(mechanism, timeout, timed_group)
        costs.append(time.perf_counter() - start)
    cost = 1e6 * statistics.median(costs) if costs else None
    if rank == 1:
        if mechanism == "StallGuard":
            from loops_callbacks.distributed import ProcessGroup, StallGuard

            StallGuard(ProcessGroup(), timeout).note(WHERE)  # what the scoring notes as it goes
        time.sleep(3 * timeout + 2)  # the stall, in PHASE: the other rank gives up first
        return None, "stalled on purpose", cost
    start = time.perf_counter()
    try:
        _meet(mechanism, timeout, timed_group)
        message = "no error"
    except Exception as error:  # noqa: BLE001 - what each mechanism raises is the figure
        message = f"{type(error).__name__}: {error}"
    return time.perf_counter() - start, message, cost


def run(mechanism: str, timeout: float, meetings: int) -> dict:
    """Each rank's (seconds to the error, message, median µs per meeting) for ``mechanism``."""
    with mp.Manager() as manager:
        results = manager.dict()
        port = _free_port()
        processes = [mp.get_context("fork").Process(target=_rank, args=(rank, port, mechanism, timeout, meetings,
                                                                          results)) for rank in (0, 1)]
        for process in processes:
            process.start()
        for process in processes:
            process.join(timeout=6 * timeout + 60)
            if process.is_alive():
                process.kill()
        return dict(results)


def main() -> None:
    from benchmarks.machine import cpu_name

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds every mechanism waits")
    parser.add_argument("--meetings", type=int, default=200, help="meetings timed without a stall")
    parser.add_argument("--only", choices=MECHANISMS, help="one mechanism (the smoke test's)")
    args = parser.parse_args()
    print(f"CPU: {cpu_name()}; rank 1 stalls in {PHASE!r}; timeout {args.timeout:g} s")
    print()
    print("| mechanism | one meeting, no stall (µs) | rank 0: s to the error | names rank 1 | names the phase "
          "| says where rank 1 was | rank 0's message |")
    print("|---|---|---|---|---|---|---|")
    for mechanism in [args.only] if args.only else MECHANISMS:
        results = run(mechanism, args.timeout, args.meetings)
        seconds, message, cost = results.get(0, (None, "rank 0 gave no result", None))
        names_rank = "yes" if "rank 1" in message.lower() or "rank(s) 1" in message.lower() else "no"
        names_phase = "yes" if PHASE in message else "no"
        names_where = "yes" if WHERE in message else "no"
        took = "never" if seconds is None else f"{seconds:.2f}"
        cost_text = "n/a" if cost is None else f"{cost:.0f}"
        short = " ".join(message.split())[:160].replace("|", "/")
        print(f"| {mechanism} | {cost_text} | {took} | {names_rank} | {names_phase} | {names_where} | {short} |")


if __name__ == "__main__":
    main()
