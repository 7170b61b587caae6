"""Where the GPU time goes (``torch.profiler``): the reference scorer's paths and the monitor's logged hook.

1. One pass of each scoring path over ``bench_reference.py``'s prompts (the medium model in bfloat16; the small one
   in float32 with ``--quick``): a bare forward, a plain forward with one float32 log-softmax, the general path and
   the output-head path; per path the wall time, the sum of kernel times and the costliest operators.
2. One logged step of ``bench_callback.py``'s run under the monitor: its wall time, the kernels it launches and the
   device time they add up to.

    python benchmarks/gpu_profile.py [--quick]

Needs a CUDA device (exit status 3 and one line without one).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")


def kernel_ms(events: Any) -> float:
    """The device time of the kernels, as the profiler's table totals it (each kernel once, not again in its op)."""
    from torch.autograd import DeviceType

    return sum(e.self_device_time_total for e in events
               if e.device_type == DeviceType.CUDA and not e.is_user_annotation) / 1e3


def profiled(fn: Any) -> tuple[float, Any]:
    """The wall seconds of one call of ``fn`` (after one warm-up call), and its profile."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return wall, prof.key_averages()


def scoring(quick: bool) -> None:
    import bench_reference

    from loops_callbacks.reference.clients import TorchSamplingClient
    from loops_callbacks.reference.packing import PackedTokens

    dtype = "float32" if quick else "bfloat16"
    args = argparse.Namespace(model="small" if quick else "medium", seed=0, quick=quick, dtype=dtype)
    model, prompts = bench_reference.build_model(args), bench_reference.build_prompts(args)
    packed, device = PackedTokens.from_sequences(prompts), torch.device("cuda")
    head = TorchSamplingClient(model, device=device, dtype=dtype, max_tokens_per_batch=16384)
    general = TorchSamplingClient(model, device=device, max_tokens_per_batch=16384, output_head=False)
    head.compute_logprobs_batch(prompts[:4])  # the head path's one-time check
    general.compute_logprobs_batch(prompts[:4])
    batches = bench_reference.padded_batches(head, prompts)
    print(f"scoring: {args.model} model, {dtype}, {packed.num_tokens} tokens, {len(batches)} batches")
    for name, fn in {"bare forward": lambda: bench_reference.bare_forward(model, batches),
                     "forward + float32 log-softmax": lambda: bench_reference.forward_and_log_softmax(model, batches),
                     "general path": lambda: general.score_packed(packed),
                     "output-head path": lambda: head.score_packed(packed)}.items():
        wall, events = profiled(fn)
        kernels = kernel_ms(events)
        top = sorted((e for e in events if e.key.startswith("aten::")), key=lambda e: -e.self_device_time_total)[:5]
        print(f"{name:<30} wall {wall * 1e3:7.1f} ms | kernels {kernels:7.1f} ms | "
              + ", ".join(f"{e.key.removeprefix('aten::')} {e.self_device_time_total / 1e3:.1f}" for e in top))


def logged_hook(quick: bool) -> None:
    import bench_callback
    import lightning.pytorch as pl

    from loops_callbacks import KLSampleTrainMonitor

    profiled_step = 49 if quick else 149  # the monitor logs steps 49, 99, 149 (Lightning's default interval)

    class Profiled(KLSampleTrainMonitor):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.fit_loop.epoch_loop._batches_that_stepped != profiled_step:
                return super().on_train_batch_end(trainer, *args)
            torch.cuda.synchronize()
            start = time.perf_counter()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                super().on_train_batch_end(trainer, *args)
                torch.cuda.synchronize()
            wall = time.perf_counter() - start
            events = prof.key_averages()
            launches = sum(e.count for e in events if e.key in LAUNCHES)
            kernels = kernel_ms(events)
            print(f"monitor, logged step {profiled_step}: wall {wall * 1e3:.1f} ms under the profiler | "
                  f"{launches} kernel launches | kernels {kernels:.2f} ms")

    warnings.filterwarnings("ignore")
    trainer = pl.Trainer(accelerator="gpu", devices=1, max_steps=profiled_step + 1, logger=bench_callback.NullLogger(),
                         callbacks=[Profiled()], enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(bench_callback.Policy())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the small model, a shorter run: a smoke test")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_profile.py: no CUDA device here; nothing was run", file=sys.stderr)
        sys.exit(3)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    scoring(args.quick)
    logged_hook(args.quick)


if __name__ == "__main__":
    main()
