"""The monitor's cost on a real vocabulary: SmolLM2-135M-Instruct GRPO steps, with the trainer's entropies.

``benchmarks/real_model.py``'s ``RealGRPO`` (2 chat prompts x 4 completions of up to 32 tokens a step: sampling,
the policy's forward and backward, Adam) runs under a ``KLSampleTrainMonitor`` that logs every other step, so that
steps it logs and steps it does not alternate in one run. On the steps it logs, the step also computes the trainer's
entropies (``token_logprobs(..., with_entropy=True)``: one more pass over the 49,152 logits of each position), as
``KLSampleTrainMonitor.logs_this_step`` lets a loop do; there the plain ``token_logprobs`` is also timed on the same
logits, right before or after (alternating), so the entropies' extra cost is measured side by side. The time spent
inside the monitor's hook is measured directly on every step. It prints the median step, the monitor's cost on a
logged and on a not-logged step, and the average over Lightning's default interval (one logged step in
``--interval``, 50), as a share of a step and as the ratio of steps with the monitor to steps without::

    OMP_NUM_THREADS=2 python benchmarks/bench_real_model_overhead.py --cache-dir /tmp/rm_cache
    python benchmarks/bench_real_model_overhead.py --steps 2 --completion 4   # a smoke run

Nothing is asserted on the times (a shared machine's figures move); the run checks that the monitor judged its
logged steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import cpu_name  # noqa: E402
from real_model import build  # noqa: E402


class Scoring:
    """``loops_callbacks.token_logprobs`` as ``RealGRPO`` calls it, timed: on a call with entropies (a logged step)
    the plain call is timed on the same logits too, before or after it in turn; its result is not used."""

    def __init__(self, function: Any) -> None:
        self.function, self.plain, self.entropy, self.calls = function, [], [], 0

    def __call__(self, logits: Any, targets: Any, **options: Any) -> Any:
        if not options.get("with_entropy"):
            return self.function(logits, targets, **options)
        self.calls += 1
        order = (False, True) if self.calls % 2 else (True, False)
        for entropy in order:
            start = time.perf_counter()
            result = self.function(logits, targets, **{**options, "with_entropy": entropy})
            (self.entropy if entropy else self.plain).append(time.perf_counter() - start)
            if entropy:
                kept = result
        return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps (half of them logged)")
    parser.add_argument("--completion", type=int, default=32, help="completion tokens at most")
    parser.add_argument("--interval", type=int, default=50, help="the logging interval averaged over (Lightning's "
                        "default log_every_n_steps)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args()
    model_dir = build(args.cache_dir)

    import lightning.pytorch as pl
    import torch

    import loops_callbacks
    from loops_callbacks import KLSampleTrainMonitor

    from bench_callback import NullLogger

    class StepTimes(pl.Callback):
        """Each step's wall time, from the first callback's batch start to the last callback's batch end."""

        def __init__(self) -> None:
            self.start, self.seconds = 0.0, []

        def on_train_batch_start(self, *args: Any) -> None:
            self.start = time.perf_counter()

    class StepEnd(pl.Callback):
        def __init__(self, times: StepTimes) -> None:
            self.times = times

        def on_train_batch_end(self, *args: Any) -> None:
            self.times.seconds.append(time.perf_counter() - self.times.start)

    class TimedMonitor(KLSampleTrainMonitor):
        """The monitor, with the time inside its hook recorded per step and whether it logged then."""

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.hook: list[tuple[bool, float]] = []

        def on_train_batch_end(self, *args: Any) -> None:
            before = self.guard_rail.logged_steps
            start = time.perf_counter()
            super().on_train_batch_end(*args)
            self.hook.append((self.guard_rail.logged_steps > before, time.perf_counter() - start))

    scoring = Scoring(loops_callbacks.token_logprobs)
    loops_callbacks.token_logprobs = scoring  # RealGRPO imports it when it is built
    try:
        from real_model import real_grpo

        pl.seed_everything(args.seed, verbose=False)
        torch.manual_seed(args.seed)
        module = real_grpo(model_dir, completion=args.completion)
    finally:
        loops_callbacks.token_logprobs = scoring.function
    times = StepTimes()
    monitor = TimedMonitor(log_every_n_steps=2)
    pl.Trainer(max_steps=args.steps, callbacks=[times, monitor, StepEnd(times)], logger=NullLogger(),
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
               num_sanity_val_steps=0).fit(module)
    if not monitor.guard_rail.judged_steps:
        raise SystemExit("the monitor judged no step (every group tied?): nothing to measure")

    logged = [seconds for was_logged, seconds in monitor.hook if was_logged]
    quiet = [seconds for was_logged, seconds in monitor.hook if not was_logged]
    extra = [e - p for e, p in zip(scoring.entropy, scoring.plain)]
    # a step without the monitor: the step less the monitor's hook and, on a step that computed the entropies, that
    # call (the plain call timed beside it stands for the step's own scoring)
    bare, entropies = [], iter(scoring.entropy)
    for seconds, (was_logged, hook) in zip(times.seconds, monitor.hook):
        bare.append(seconds - hook - (next(entropies, 0.0) if was_logged else 0.0))
    step = statistics.median(bare)
    logged_cost = statistics.median(logged) + (statistics.median(extra) if extra else 0.0)
    quiet_cost = statistics.median(quiet) if quiet else 0.0
    average = (logged_cost + (args.interval - 1) * quiet_cost) / args.interval
    print(f"CPU: {cpu_name()}; torch threads {torch.get_num_threads()}")
    print(f"SmolLM2-135M-Instruct GRPO step (8 x {args.completion} tokens: sampling, forward, backward, Adam), "
          f"without the monitor: median {step:.2f} s over {len(bare)} steps (min {min(bare):.2f}, max {max(bare):.2f})")
    print(f"trainer entropies (with_entropy=True) on a logged step: +{1e3 * statistics.median(extra):.1f} ms "
          f"(plain token_logprobs {1e3 * statistics.median(scoring.plain):.1f} ms, with entropies "
          f"{1e3 * statistics.median(scoring.entropy):.1f} ms, same logits, {len(extra)} pairs)" if extra else
          "trainer entropies: no logged step computed them")
    print(f"monitor hook: logged step {1e3 * statistics.median(logged):.1f} ms ({len(logged)} steps), not logged "
          f"{1e6 * quiet_cost:.1f} us ({len(quiet)} steps)")
    print(f"averaged over the default interval (1 logged step in {args.interval}): {1e3 * average:.2f} ms a step = "
          f"{100 * average / step:.3f}% of a step; steps with the monitor / without: {(step + average) / step:.4f}")
    print(f"a logged step alone: {1e3 * logged_cost:.1f} ms = {100 * logged_cost / step:.2f}% of a step")


if __name__ == "__main__":
    main()
