"""``token_logprobs`` against the three implementations it replaced: time per call, and each one's error.

Each path is timed as its caller runs it, on random ``[B, T, V]`` logits (best of ``--repeats``):

- ``policy`` (``DPOModule``, the RL demo's trainer): with autograd, forward and backward;
- ``validation``: the policy's forward without autograd (now in 16 MiB row chunks);
- ``reference``: the scorer's general path (inference mode, float32 result).

and every result is compared with the old implementation (the largest difference) and with a float64
computation of the same logits (the mean error, signed: a fused float32 ``log_softmax`` on a CPU reads
every token a little high or low, the logsumexp route does not)::

    OMP_NUM_THREADS=1 python benchmarks/bench_token_logprobs.py --shape 8 256 32768 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import torch

from loops_callbacks.logprobs import token_logprobs

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.logprobs_before import policy_before, reference_before  # noqa: E402


def best_of(repeats: int, call: Callable[[], torch.Tensor]) -> tuple[float, torch.Tensor]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = call()
        times.append(time.perf_counter() - start)
    assert out is not None
    return min(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=int, nargs=3, default=[8, 256, 32768], metavar=("B", "T", "V"))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    batch, width, vocab = args.shape
    torch.manual_seed(0)
    print(f"logits [{batch}, {width}, {vocab}], best of {args.repeats}, {torch.get_num_threads()} torch thread(s)")
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(batch, width, vocab) * 4).to(dtype)
        targets = torch.randint(0, vocab, (batch, width))

        def backward(function: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
            leaf = logits.clone().requires_grad_()
            function(leaf, targets).sum().backward()
            assert leaf.grad is not None
            return leaf.grad

        def inference(function: Callable[..., torch.Tensor], **kwargs: object) -> Callable[[], torch.Tensor]:
            def call() -> torch.Tensor:
                with torch.inference_mode():
                    return function(logits, targets, **kwargs)

            return call

        cases = {
            "policy (forward + backward)": (lambda: backward(policy_before), lambda: backward(token_logprobs)),
            "validation (no autograd)": (inference(policy_before), inference(token_logprobs)),
            "reference (inference)": (inference(reference_before), inference(token_logprobs, dtype=torch.float32)),
        }
        exact = torch.log_softmax(logits.double(), -1).gather(-1, targets[..., None])[..., 0]
        for name, (old, new) in cases.items():
            old_time, old_out = best_of(args.repeats, old)
            new_time, new_out = best_of(args.repeats, new)
            bias = "(a gradient)"  # no float64 value to hold it against
            if old_out.shape == exact.shape:
                old_bias, new_bias = ((out.double() - exact).mean().item() for out in (old_out, new_out))
                bias = f"before {old_bias:+.1e} now {new_bias:+.1e}"
            most = (old_out.double() - new_out.double()).abs().max().item()
            print(f"{str(dtype):15} {name:28} before {old_time * 1e3:8.1f} ms   now {new_time * 1e3:8.1f} ms   "
                  f"ratio {new_time / old_time:5.2f}   max|diff| {most:.1e}   bias {bias}")


if __name__ == "__main__":
    main()
