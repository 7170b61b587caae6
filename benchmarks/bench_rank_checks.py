"""What the cross-rank checks of DPO data cost, and what sharded tokenization saves, on two gloo ranks (CPU).

Each rank, ``--repeats`` times (medians of wall and CPU time printed by rank 0; on a busy machine
the CPU time is the figure to read, the work each rank does):

* the demo's data (``dpo_tiny``: 1,024 token-id pairs of the reverse-digits task): the whole
  ``DPODataModule.dpo_data()`` on two ranks (records compared across ranks, limits and tokenizer
  compared, each rank building half of the pairs, the halves gathered) against what every rank
  did before, ``preference_pairs`` on all of them;
* the check of the datums' token ids that ``score_across_ranks`` runs before scoring (a count and
  a digest per rank; ``check_ranks_agree``), on the demo's 2,048 datums;
* the shipped chat data (512 records, the shipped tokenizer): ``dpo_data()`` on two ranks (each
  tokenizes half) against ``preference_pairs`` on all of them in each rank.

    OMP_NUM_THREADS=1 python benchmarks/bench_rank_checks.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
CHAT = os.path.join(ROOT, "configs", "data", "chat_preferences.jsonl")
TOKENIZER = os.path.join(ROOT, "configs", "data", "chat_tokenizer")


def _median_ms(work: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """Median wall and CPU milliseconds of this rank (CPU time is the work; wall time also waits for the other rank)."""
    wall, cpu = [], []
    for _ in range(repeats):
        torch.distributed.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        work()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return 1000 * statistics.median(wall), 1000 * statistics.median(cpu)


def _rank(rank: int, port: int, repeats: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    warnings.simplefilter("ignore")
    from transformers import AutoTokenizer

    from loops_callbacks.data import DPODataModule
    from loops_callbacks.data.sources import read_preference_records
    from loops_callbacks.data.tokenization import preference_pairs
    from loops_callbacks.demo.data import ReversePairsDataModule
    from loops_callbacks.reference.cache import data_fingerprint
    from loops_callbacks.distributed import ProcessGroup, StallGuard
    from loops_callbacks.reference.rank_agreement import check_ranks_agree, token_digests

    demo = ReversePairsDataModule(num_pairs=1024, progress=False)
    records = demo.data
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    chat = DPODataModule(path=CHAT, tokenizer=tokenizer, progress=False)

    def again(module: DPODataModule) -> Callable[[], Any]:
        if "_read" not in vars(module):
            raise AttributeError("DPODataModule keeps its pairs elsewhere than _read: the timing would read them")

        def load() -> Any:
            module._read = None  # read, check and tokenize again
            return module.dpo_data()

        return load

    rows = {
        "demo 1,024 pairs: dpo_data() on 2 ranks (checks + half each)": _median_ms(again(demo), repeats),
        "demo 1,024 pairs: preference_pairs on all (each rank, before)": _median_ms(
            lambda: preference_pairs(records, progress=False, warn=False), repeats
        ),
    }
    packed = demo.dpo_data().tokens
    group = ProcessGroup()
    guard = StallGuard(group, 600.0)

    def check_tokens() -> None:  # what score_across_ranks runs before scoring
        check_ranks_agree(group, what="datums", count=len(packed), digest=data_fingerprint(packed),
                          item_digests=lambda: token_digests(packed), item_name=str, guard=guard)

    rows["demo 2,048 datums: token-id check before scoring"] = _median_ms(check_tokens, repeats)
    rows["chat 512 records: dpo_data() on 2 ranks (checks + half each)"] = _median_ms(again(chat), repeats)
    rows["chat 512 records: preference_pairs on all (each rank, before)"] = _median_ms(
        lambda: preference_pairs(read_preference_records(CHAT), tokenizer, progress=False, warn=False), repeats
    )
    everyone: list[Any] = [None, None]
    torch.distributed.all_gather_object(everyone, rows)
    if rank == 0:
        print(f"median of {repeats} runs, milliseconds (2 gloo ranks, torch threads 1): wall | CPU rank 0, rank 1")
        for name in rows:
            (wall, cpu0), (_, cpu1) = everyone[0][name], everyone[1][name]
            print(f"  {name:<68} {wall:8.1f} | {cpu0:8.1f} {cpu1:8.1f}")
    torch.distributed.barrier()  # rank 0 holds the store: no rank leaves while another still reads it
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    mp.start_processes(_rank, args=(port, args.repeats), nprocs=2, start_method="fork")  # nothing runs here yet


if __name__ == "__main__":
    main()
