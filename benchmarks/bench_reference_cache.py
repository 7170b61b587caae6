"""What reading the reference-logprob cache into memory costs: time and memory per process.

A cache hit reads the file (safetensors) into the process's memory and checksums exactly the bytes
read (a file changed or truncated under a running job cannot change its values, nor kill it with
SIGBUS). A memory map (as safetensors' own readers and earlier versions did) needs no private copy,
but the values are the file's pages. This writes a cache of ``--tokens`` float32 values in a temporary directory and
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
    from loops_callbacks.reference.cache import CacheKey, checksum, read_cache, read_header

    def rss():
        fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
        return {name: int(fields[name].split()[0]) / 1024 for name in ("RssAnon", "RssFile")}

    path, method, datums, per = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    lengths = np.full(datums, per)
    before = rss()
    start = time.perf_counter()
    if method == "read":  # what a cache hit does now
        flat = read_cache(path, CacheKey("r", "d", "float32"), lengths).flat
    else:  # a memory map (copy-on-write), the same header and checksum read from it
        blob = np.memmap(path, dtype=np.uint8, mode="c")
        header = read_header(bytes(blob[: 1 << 20]), len(blob))
        (_, first, stop), (_, first_lengths, stop_lengths) = header.tensors["values"], header.tensors["lengths"]
        flat = blob[first:stop].view("<f4")
        assert checksum(blob[first_lengths:stop_lengths].view("<i8"), flat) == header.checksum
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
