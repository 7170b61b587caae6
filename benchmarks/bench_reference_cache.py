"""What reading the reference-logprob cache into memory costs: time and memory per process.

A cache hit reads the file into the process's memory (safetensors' ``pread`` backend) and checksums
exactly the values read (a file changed or truncated under a running job cannot change its values,
nor kill it with SIGBUS). safetensors' default backend maps the file instead. This writes a cache of ``--tokens`` float32 values in a temporary directory and
loads it in a fresh process per method, printing the load time and the process's resident
memory after the load (private ``RssAnon`` and file-backed ``RssFile``, from /proc)::

    OMP_NUM_THREADS=1 python benchmarks/bench_reference_cache.py --tokens 50000000
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap

import numpy as np

from loops_callbacks.reference.cache import CacheKey, write_cache

LOAD = """
    import sys, time
    import numpy as np
    from safetensors import safe_open
    from loops_callbacks.reference.cache import CacheKey, checksum, read_cache

    def rss():
        fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
        return {name: int(fields[name].split()[0]) / 1024 for name in ("RssAnon", "RssFile")}

    path, method, datums, per = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    lengths = np.full(datums, per)
    before = rss()
    start = time.perf_counter()
    if method == "read":  # what a cache hit does now
        flat = read_cache(path, CacheKey("r", "d", "float32"), lengths).flat
    else:  # safetensors' default backend, a memory map; the same checksum
        with safe_open(path, "np") as file:
            flat, stored = file.get_tensor("values"), file.get_tensor("lengths")
            assert checksum(stored, flat) == file.metadata()["sha256"]
    total = float(flat.sum(dtype=np.float64))  # every value is touched, as training does over an epoch
    seconds = time.perf_counter() - start
    after = rss()
    print(f"{method:5s} {seconds:6.2f} s  RssAnon +{after['RssAnon'] - before['RssAnon']:7.1f} MiB  "
          f"RssFile +{after['RssFile'] - before['RssFile']:7.1f} MiB  (sum {total:.1f})")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=50_000_000, help="float32 values in the cache")
    parser.add_argument("--tokens-per-datum", type=int, default=500)
    args = parser.parse_args()
    datums = args.tokens // args.tokens_per_datum
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "ref_logprobs.cache")
        values = np.random.default_rng(0).standard_normal(datums * args.tokens_per_datum, dtype=np.float32)
        values = np.negative(np.abs(values, out=values), out=values)  # logprobs: write_cache refuses others
        write_cache(path, CacheKey("r", "d", "float32"), values, np.full(datums, args.tokens_per_datum))
        del values
        size = os.path.getsize(path) / (1 << 20)
        print(f"cache: {datums:,} datums, {datums * args.tokens_per_datum:,} tokens, {size:.1f} MiB")
        for method in ("read", "mmap"):
            run = subprocess.run(
                [sys.executable, "-c", textwrap.dedent(LOAD), path, method, str(datums), str(args.tokens_per_datum)],
                capture_output=True, text=True, check=True,
            )
            print(run.stdout.strip())


if __name__ == "__main__":
    main()
