"""Peak memory of a DPODataModule's setup on token-id records: reading, checking, scoring, the first batches.

Each measurement runs in its own subprocess (the package found from the working directory, so a
checkout of another commit can be measured with the same script): it builds the records, reads
its peak RSS (``ru_maxrss``), runs ``setup("fit")`` with a tiny ``TorchSamplingClient`` reference
(no cache) and one pass over ``train_dataloader()``, and reports the growth of the peak RSS, the
time and a digest of the batches (equal digests: the same numbers).

Usage:
    OMP_NUM_THREADS=1 python benchmarks/bench_dpo_setup_memory.py
    OMP_NUM_THREADS=1 python benchmarks/bench_dpo_setup_memory.py --pairs 2000 8000 --length 128
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import hashlib, json, resource, sys, time
import numpy as np, torch
from loops_callbacks.data import DPODataModule
from loops_callbacks.reference.clients import TorchSamplingClient

pairs, length = int(sys.argv[1]), int(sys.argv[2])
rng = np.random.default_rng(0)
records = []
for _ in range(pairs):
    prompt = rng.integers(1, 64, length // 2).tolist()
    records.append({"chosen": prompt + rng.integers(1, 64, length // 2).tolist(),
                    "rejected": prompt + rng.integers(1, 64, length // 2 - 1).tolist(), "prompt_length": length // 2})
torch.manual_seed(0)
reference = TorchSamplingClient(torch.nn.Sequential(torch.nn.Embedding(64, 8), torch.nn.Linear(8, 64)))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
started = time.perf_counter()
data = DPODataModule(records, reference=reference, use_cache=False, progress=False, batch_size=64, shuffle=False)
data.setup("fit")
digest = hashlib.sha256()
for batch in data.train_dataloader():
    for key in ("input_ids", "target_tokens", "weights", "ref_logprobs"):
        digest.update(batch[key].numpy().tobytes())
seconds = time.perf_counter() - started
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"growth_mb": (after - before) / 1024, "seconds": seconds, "digest": digest.hexdigest()[:16]}))
"""


def measure(pairs: int, length: int) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(pairs), str(length)], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, nargs="+", default=[2000, 8000], help="numbers of records")
    parser.add_argument("--length", type=int, default=128, help="tokens of a chosen sequence")
    args = parser.parse_args()
    print(f"tokens per pair ~{2 * args.length}; peak RSS growth (ru_maxrss) of setup('fit') + one pass of batches")
    print(f"{'pairs':>8}  {'tokens':>10}  {'peak RSS growth MB':>18}  {'seconds':>7}  digest")
    for pairs in args.pairs:
        result = measure(pairs, args.length)
        tokens = pairs * (2 * args.length - 1)
        print(f"{pairs:>8}  {tokens:>10,}  {result['growth_mb']:>18.1f}  {result['seconds']:>7.2f}  {result['digest']}")


if __name__ == "__main__":
    main()
