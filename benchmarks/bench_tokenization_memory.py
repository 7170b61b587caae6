"""Peak memory of tokenizing one huge preference record with ``max_length``: a window of its text vs the whole text.

Each measurement runs in its own subprocess: it builds the record, reads its peak RSS
(``ru_maxrss``), runs ``preference_pairs`` with the shipped tokenizer
(``configs/data/chat_tokenizer``) and reports the growth of the peak RSS and the time. "window" is
the package's path (a window of the text, ``loops_callbacks.data.token_window``); "whole"
tokenizes the whole text first, as before (windows switched off). The whole text of a 50 MB
record takes minutes and ~19 GB, so "whole" is measured on smaller records by default.

Usage:
    OMP_NUM_THREADS=1 python benchmarks/bench_tokenization_memory.py
    OMP_NUM_THREADS=1 python benchmarks/bench_tokenization_memory.py --window-mb 50 --whole-mb 1 2 --max-length 128

A record size given for both paths is measured once per path (the smallest "whole" size always is:
its ids are the window's reference).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, resource, sys, time
from loops_callbacks.data import tokenization, tokenizer as tokenizing

mode, fmt, megabytes, max_length = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
tokenizer = tokenizing.load_tokenizer(sys.argv[5])
sentence = "The quick brown fox jumps over the lazy dog 1234 times, naïvely. "
text = sentence * int(megabytes * 1e6 / len(sentence.encode()))
if fmt == "standard":
    record = {"prompt": "Write a very long story.", "chosen": " " + text, "rejected": " No."}
else:
    record = {"prompt": [{"role": "user", "content": "Write a very long story."}],
              "chosen": [{"role": "assistant", "content": text}], "rejected": [{"role": "assistant", "content": "No."}]}
if mode == "whole":
    tokenizing.worth_a_window = lambda *args: False
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
started = time.perf_counter()
data, report = tokenization.preference_pairs([record], tokenizer, max_length=max_length, progress=False, warn=False)
seconds = time.perf_counter() - started
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"growth_mb": (after - before) / 1024, "seconds": seconds,
                  "ids": [d.model_input.to_ints() for d in data.datums()]}))
"""


def measure(mode: str, fmt: str, megabytes: float, max_length: int, tokenizer: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, mode, fmt, str(megabytes), str(max_length), tokenizer],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window-mb", type=float, nargs="+", default=[50.0], help="record sizes for the window path")
    parser.add_argument("--whole-mb", type=float, nargs="+", default=[1.0, 2.0], help="record sizes for the whole text")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--formats", nargs="+", default=["standard", "conversational"])
    parser.add_argument("--tokenizer", default=str(ROOT / "configs" / "data" / "chat_tokenizer"))
    args = parser.parse_args()
    print(f"max_length={args.max_length}; peak RSS growth (ru_maxrss) of preference_pairs on one record")
    print(f"{'format':<15} {'path':<7} {'record MB':>9} {'peak RSS growth MB':>19} {'seconds':>8}  same ids")
    for fmt in args.formats:
        smallest = min(args.whole_mb)
        measured = {(mode, smallest): measure(mode, fmt, smallest, args.max_length, args.tokenizer)
                    for mode in ("window", "whole")}
        same = measured["whole", smallest]["ids"] == measured["window", smallest]["ids"]  # the window's = the whole's
        for mode, sizes in (("whole", args.whole_mb), ("window", args.window_mb)):
            for megabytes in sizes:
                if (mode, megabytes) not in measured:
                    measured[mode, megabytes] = measure(mode, fmt, megabytes, args.max_length, args.tokenizer)
                result = measured[mode, megabytes]
                print(
                    f"{fmt:<15} {mode:<7} {megabytes:>9.1f} {result['growth_mb']:>19.1f} {result['seconds']:>8.2f}  "
                    f"{same if mode == 'window' else ''}"
                )


if __name__ == "__main__":
    main()
