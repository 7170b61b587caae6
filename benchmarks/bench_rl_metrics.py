"""Speed and memory of the divergence functions, side by side with a per-token implementation.

Runs, in one process, ``loops_compute_kl_sample_train`` / ``loops_log_kl_sample_train`` and the
per-token pure-Python statement of the same semantics in ``tests/oracle.py`` (the way the SDK
computes them: read each datum's fields into lists, walk the tokens, sort for the percentiles)
on B datums x T positions (~10% masked out), for tensor inputs and for list-backed
``TensorData``, and prints ratios, with the floors the targets are measured against:
``numpy.percentile(|d|, [50, 90, 99])`` for tensors, ``numpy.array`` of the fields for lists.
Peak extra memory is measured in a child process (resident memory sampled during the call, minus
before it) in float64 copies of the positions.
Torch runs on one thread by default, like the per-token code and numpy it is compared with.

    python benchmarks/bench_rl_metrics.py            # 1,000 x 1,000
    python benchmarks/bench_rl_metrics.py --quick    # 200 x 500, seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from loops_callbacks import loops_compute_kl_sample_train, loops_log_kl_sample_train  # noqa: E402
from loops_callbacks.types import Datum, ModelInput, TensorData  # noqa: E402
from tests import oracle  # noqa: E402


def make_batch(n_datums: int, length: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    sampler = -rng.exponential(1.0, size=(n_datums, length))
    trainer = np.minimum(sampler + rng.normal(0.0, 0.05, size=sampler.shape), 0.0)  # logprobs are <= 0
    mask = (rng.random(sampler.shape) > 0.1).astype(np.float64)
    advantages = rng.normal(size=(n_datums, 1))
    tokens = rng.integers(0, 32000, size=(n_datums, length))
    return {"sampler": sampler, "trainer": trainer, "mask": mask, "advantages": advantages, "tokens": tokens}


def tensor_inputs(b: dict[str, np.ndarray]) -> tuple[list[Datum], list[torch.Tensor]]:
    datums = [
        Datum(
            ModelInput.from_ints(b["tokens"][i].tolist()),
            {
                "logprobs": torch.from_numpy(b["sampler"][i]).float(),
                "mask": torch.from_numpy(b["mask"][i]).float(),
                "advantages": torch.from_numpy(b["advantages"][i]).float(),
                "target_tokens": torch.from_numpy(b["tokens"][i]),
            },
        )
        for i in range(len(b["sampler"]))
    ]
    return datums, [torch.from_numpy(row).float() for row in b["trainer"]]


def list_inputs(b: dict[str, np.ndarray]) -> tuple[list[Datum], list[TensorData]]:
    datums = [
        Datum(
            ModelInput.from_ints(b["tokens"][i].tolist()),
            {
                "logprobs": TensorData(b["sampler"][i].tolist(), "float32"),
                "mask": TensorData(b["mask"][i].tolist(), "float32"),
                "advantages": TensorData(b["advantages"][i].tolist(), "float32"),
                "target_tokens": TensorData(b["tokens"][i].tolist(), "int64"),
            },
        )
        for i in range(len(b["sampler"]))
    ]
    return datums, [TensorData(row.tolist(), "float32") for row in b["trainer"]]


def oracle_rows(b: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    return [
        {
            "logprobs": b["sampler"][i].tolist(),
            "trainer": b["trainer"][i].tolist(),
            "mask": b["mask"][i].tolist(),
            "advantages": b["advantages"][i].tolist(),
            "tokens": b["tokens"][i].tolist(),
            "target_tokens": b["tokens"][i].tolist(),
        }
        for i in range(len(b["sampler"]))
    ]


def best_of(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def per_token(datums: list[Datum], trainer: list[Any]) -> list[dict[str, Any]]:
    rows = oracle.rows_from_datums(datums, trainer)
    oracle.metrics(rows, pure_python=True)
    return rows


def per_token_log(datums: list[Datum], trainer: list[Any]) -> None:
    import wandb

    rows = per_token(datums, trainer)
    wandb.Histogram(oracle.histogram(rows))
    wandb.Table(columns=["rank", "datum", "position", "token", "logp_sampler", "logp_trainer", "diff",
                         "is_weight", "context"], data=oracle.worst_rows(rows), allow_mixed_types=True)


def peak_copies(form: str, n_datums: int, length: int) -> float:
    """Max-RSS growth of one call, in float64 copies of the positions (fresh child process)."""
    out = subprocess.run(
        [sys.executable, __file__, "--child-memory", form, "--datums", str(n_datums), "--length", str(length)],
        check=True, capture_output=True, text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["copies"]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def child_memory(form: str, n_datums: int, length: int) -> None:
    """Resident memory sampled every 0.2 ms during one call, minus the resident memory before it."""
    batch = make_batch(n_datums, length)
    datums, trainer = tensor_inputs(batch) if form == "tensor" else list_inputs(batch)
    del batch
    loops_log_kl_sample_train(None, 0, datums[:2], training_logprobs=trainer[:2])  # imports, warm-up
    gc.collect()
    baseline, peak, done = _rss_bytes(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            time.sleep(0.0002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    loops_log_kl_sample_train(None, 0, datums, training_logprobs=trainer)
    done.set()
    sampler.join()
    print(json.dumps({"copies": (peak[0] - baseline) / (8 * n_datums * length)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datums", type=int, default=1000)
    parser.add_argument("--length", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: the same single core as the per-token and numpy floors)")
    parser.add_argument("--device", default="cpu", help="where the tensor inputs live (cpu, cuda)")
    parser.add_argument("--child-memory", choices=["tensor", "list"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        args.datums, args.length, args.repeats = 200, 500, 3
    if args.child_memory:
        child_memory(args.child_memory, args.datums, args.length)
        return

    batch = make_batch(args.datums, args.length)
    rows = oracle_rows(batch)
    tensor_datums, tensor_trainer = tensor_inputs(batch)
    list_datums, list_trainer = list_inputs(batch)
    if args.device != "cpu":
        device_datums = [
            Datum(d.model_input, {k: v.to(args.device) for k, v in d.loss_fn_inputs.items()}) for d in tensor_datums
        ]
        device_trainer = [t.to(args.device) for t in tensor_trainer]
        loops_log_kl_sample_train(None, 0, device_datums, training_logprobs=device_trainer)  # warm-up
        on_device = best_of(lambda: loops_compute_kl_sample_train(device_datums, device_trainer), args.repeats)
        on_device_log = best_of(
            lambda: loops_log_kl_sample_train(None, 0, device_datums, training_logprobs=device_trainer), args.repeats
        )
        padded = torch.stack(device_trainer)
        on_device_padded = best_of(lambda: loops_compute_kl_sample_train(device_datums, padded), args.repeats)
    padded_trainer = torch.stack(tensor_trainer)
    n_positions = args.datums * args.length

    # The same numbers whatever the input form, and the per-token reference's.
    for datums, trainer in [(tensor_datums, tensor_trainer), (list_datums, list_trainer)]:
        want = oracle.metrics(oracle.rows_from_datums(datums, trainer), pure_python=True)
        got = loops_compute_kl_sample_train(datums, trainer)
        assert got.keys() == want.keys()
        assert all(abs(got[k] - want[k]) <= 1e-9 * max(1.0, abs(want[k])) for k in want), "results differ"
    abs_d = np.abs(np.array([t - s for _, _, s, t in oracle.action_tokens(rows)[0]]))

    t_tensor_ref = best_of(lambda: per_token(tensor_datums, tensor_trainer), 1)
    t_list_ref = best_of(lambda: per_token(list_datums, list_trainer), 1)
    t_tensor_ref_log = best_of(lambda: per_token_log(tensor_datums, tensor_trainer), 1)
    t_list_ref_log = best_of(lambda: per_token_log(list_datums, list_trainer), 1)
    t_percentile = best_of(lambda: np.percentile(abs_d, [50, 90, 99]), args.repeats)
    t_to_arrays = best_of(
        lambda: [
            np.array(d.loss_fn_inputs[k].data, dtype=np.float64)
            for d in list_datums
            for k in ("logprobs", "mask", "advantages")
        ]
        + [np.array(t.data, dtype=np.float64) for t in list_trainer],
        args.repeats,
    )
    timings = {
        "tensor rows": best_of(lambda: loops_compute_kl_sample_train(tensor_datums, tensor_trainer), args.repeats),
        "padded [B, T]": best_of(lambda: loops_compute_kl_sample_train(tensor_datums, padded_trainer), args.repeats),
        "list TensorData": best_of(lambda: loops_compute_kl_sample_train(list_datums, list_trainer), args.repeats),
    }
    log_timings = {
        "tensor rows": best_of(
            lambda: loops_log_kl_sample_train(None, 0, tensor_datums, training_logprobs=tensor_trainer), args.repeats
        ),
        "list TensorData": best_of(
            lambda: loops_log_kl_sample_train(None, 0, list_datums, training_logprobs=list_trainer), args.repeats
        ),
    }

    print(f"{args.datums} datums x {args.length} positions = {n_positions:,} positions, "
          f"{len(abs_d):,} action tokens; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"per-token reference, tensor inputs: scalars {t_tensor_ref * 1e3:,.0f} ms "
          f"({t_tensor_ref / n_positions * 1e6:.2f} us/position), with histogram + table {t_tensor_ref_log * 1e3:,.0f} ms")
    print(f"per-token reference, list inputs:   scalars {t_list_ref * 1e3:,.0f} ms "
          f"({t_list_ref / n_positions * 1e6:.2f} us/position), with histogram + table {t_list_ref_log * 1e3:,.0f} ms")
    print(f"floors: numpy.percentile {t_percentile * 1e3:.1f} ms, numpy.array of list fields {t_to_arrays * 1e3:.1f} ms")
    print()
    print(f"{'loops_compute_kl_sample_train':34s} {'ms':>8s} {'vs per-token':>13s} {'vs floor':>9s}  target")
    for name, seconds in timings.items():
        if "list" in name:
            reference, floor, target = t_list_ref, t_to_arrays, ">=15x, <=2.5x floor"
        else:
            reference, floor, target = t_tensor_ref, t_percentile, ">=100x, <=3x floor"
        print(f"  {name:32s} {seconds * 1e3:8.1f} {reference / seconds:12.0f}x {seconds / floor:8.2f}x  {target}")
    print(f"{'loops_log_kl_sample_train':34s}")
    for name, seconds in log_timings.items():
        reference, target = (t_list_ref_log, ">=25x") if "list" in name else (t_tensor_ref_log, ">=80x")
        print(f"  {name:32s} {seconds * 1e3:8.1f} {reference / seconds:12.0f}x {'':>9s}  {target}")
    if args.device != "cpu":
        print(f"on {args.device} ({torch.cuda.get_device_name() if args.device.startswith('cuda') else ''}): "
              f"compute {on_device * 1e3:.1f} ms ({t_tensor_ref / on_device:.0f}x per-token), "
              f"padded trainer {on_device_padded * 1e3:.1f} ms, "
              f"log with histogram + table {on_device_log * 1e3:.1f} ms ({t_tensor_ref_log / on_device_log:.0f}x)")
        return
    print("peak extra memory of loops_log_kl_sample_train (float64 copies of the positions, target ~10):")
    for form in ("tensor", "list"):
        print(f"  {form:32s} {peak_copies(form, args.datums, args.length):8.1f}")


if __name__ == "__main__":
    main()
