"""Reference logprobs: concurrent remote scoring and the batched local scorer, measured side by side.

Remote part: a client whose every call waits 50 ms (a network round trip), scored with
``attach_reference_logprobs(..., max_concurrency=32)`` against the Loops SDK's one-by-one loop.

Local part: a small causal transformer as the reference model (its output head exposed as Hugging
Face models expose it), 512 sequences of 16-512 tokens: ``TorchSamplingClient.score_packed`` (packed
ids in, host float32 values out) on the output-head path and on the general path, and the SDK's
list form ``compute_logprobs_batch``, against a bare forward pass of the same model over the same
padded batches, already on the device (the ceiling), and that forward plus a naive whole-batch
float32 log-softmax (each variant timed in interleaved rounds, best of ``--repeat``); then tokens/s
and peak memory for several ``max_tokens_per_batch`` budgets, measured on a second pass (the first
fills per-shape kernel caches once); on CPU each budget runs in a fresh process and the peak is the
growth of malloc'd bytes sampled every millisecond (``PeakHostMemory``); on CUDA it is the growth
of ``torch.cuda.max_memory_allocated``.

``--fit-memory``: the peak growth of host memory of a DPO ``trainer.fit`` on the CPU, from the
call until ``on_train_start`` (the reference values are ready, step 1 not begun), for a 59M-parameter
(226 MiB) LightningModule: with the default reference (the policy itself), with a ready cache, and
with ``reference=<the module>`` (a frozen copy, the old default); a fresh process each.

``--head-memory``: the peak extra memory of scoring one batch of ``--budget`` (default 8192) tokens
with a 131072-token vocabulary, on the general path (the model's logits) and the output-head path.

Every comparison asserts that the results agree (exactly for the remote part, within 1e-5 for the
float32 local one, 1e-4 for the 128k-vocabulary batch).

Usage:
    python benchmarks/bench_reference.py                 # full size, CPU
    python benchmarks/bench_reference.py --quick         # smoke test, ~30 s on 2 idle cores
    python benchmarks/bench_reference.py --device cuda --model medium --dtype bfloat16
    python benchmarks/bench_reference.py --fit-memory --head-memory   # the memory figures, CPU
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import ctypes
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from loops_callbacks.helpers.datum import attach_reference_logprobs
from loops_callbacks.reference.clients import TorchSamplingClient
from loops_callbacks.reference.packing import PackedTokens, plan_batches
from loops_callbacks.reference.scorer import _DEFAULT_TOKENS_PER_BATCH
from loops_callbacks.types import Datum, ModelInput, TensorData

MODELS = {
    # name: (vocab, width, layers, heads)
    "small": (4096, 128, 6, 4),  # 2.4M parameters
    "medium": (32768, 1024, 8, 16),  # 168M parameters, a real vocabulary (for GPUs)
}


class BenchLM(nn.Module):
    """A pre-norm causal transformer: token + learned positions, SDPA attention, GELU MLP, untied head."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, max_len: int = 1024) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(max_len, width)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "ln1": nn.LayerNorm(width),
                    "qkv": nn.Linear(width, 3 * width),
                    "out": nn.Linear(width, width),
                    "ln2": nn.LayerNorm(width),
                    "up": nn.Linear(width, 4 * width),
                    "down": nn.Linear(4 * width, width),
                }
            )
            for _ in range(layers)
        )
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def get_output_embeddings(self) -> nn.Module:
        """The output head, as Hugging Face models expose it: the scorer's output-head path uses it."""
        return self.head

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        b, t = input_ids.shape
        x = self.embed(input_ids) + self.pos(torch.arange(t, device=input_ids.device))
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["ln1"](x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + blk["out"](attn.transpose(1, 2).reshape(b, t, -1))
            x = x + blk["down"](F.gelu(blk["up"](blk["ln2"](x))))
        return self.head(self.ln_f(x))


def build_model(args: argparse.Namespace) -> nn.Module:
    vocab, width, layers, heads = MODELS[args.model]
    torch.manual_seed(args.seed)
    return BenchLM(vocab, width, layers, heads).eval().requires_grad_(False)


def build_prompts(args: argparse.Namespace) -> list[list[int]]:
    vocab = MODELS[args.model][0]
    generator = torch.Generator().manual_seed(args.seed + 1)
    n, longest = (48, 256) if args.quick else (512, 512)
    lengths = torch.randint(16, longest + 1, (n,), generator=generator).tolist()
    return [torch.randint(0, vocab, (length,), generator=generator).tolist() for length in lengths]


def row(name: str, figures: str) -> None:
    """One line of the table, printed at once (a run cut short keeps what it measured)."""
    print(f"{name:<36} {figures}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def max_abs_diff(a: list[list[float | None]], b: list[list[float | None]]) -> float:
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        assert len(x) == len(y) and (not x or (x[0] is None and y[0] is None))
        worst = max([worst, *(abs(p - q) for p, q in zip(x[1:], y[1:]))])
    return worst


# --- remote clients ------------------------------------------------------------------------------


def fake_logprobs(tokens: list[int]) -> list[float | None]:
    return [None] + [-0.01 * ((7 * t + i) % 97) for i, t in enumerate(tokens[1:], 1)]


class SlowClient:
    """A remote reference: every call takes ``delay`` seconds (sync, async and batch-less)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def compute_logprobs(self, prompt: Any) -> list[float | None]:
        time.sleep(self.delay)
        return fake_logprobs(prompt.to_ints())

    async def compute_logprobs_async(self, prompt: Any) -> list[float | None]:
        await asyncio.sleep(self.delay)
        return fake_logprobs(prompt.to_ints())


class SlowFutureClient:
    """Tinker-style: ``compute_logprobs`` returns a future that resolves after ``delay`` seconds."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=64)

    def compute_logprobs(self, prompt: Any) -> concurrent.futures.Future:
        return self.pool.submit(SlowClient(self.delay).compute_logprobs, prompt)


def sdk_loop(data: list[Datum], reference: Any) -> list[Datum]:
    """The Loops SDK's attach_reference_logprobs: one datum at a time, in order."""
    out = []
    for datum in data:
        lp = reference.compute_logprobs(datum.model_input)
        ref = [0.0 if v is None else float(v) for v in lp[1:]] + [0.0]
        inputs = {**datum.loss_fn_inputs, "ref_logprobs": TensorData(ref, "float32", [len(ref)])}
        out.append(Datum(model_input=datum.model_input, loss_fn_inputs=inputs))
    return out


def bench_remote(args: argparse.Namespace) -> None:
    n = 64 if args.quick else 512
    generator = torch.Generator().manual_seed(args.seed)
    data = [
        Datum(ModelInput.from_ints(torch.randint(0, 1000, (int(length),), generator=generator).tolist()))
        for length in torch.randint(2, 64, (n,), generator=generator)
    ]
    start = time.perf_counter()
    expected = sdk_loop(data, SlowClient(args.delay))
    sdk_s = time.perf_counter() - start
    expected_refs = [d.loss_fn_inputs["ref_logprobs"].data for d in expected]
    for name, client in (("async", SlowClient(args.delay)), ("futures", SlowFutureClient(args.delay))):
        start = time.perf_counter()
        ours = attach_reference_logprobs(data, client, max_concurrency=32)
        ours_s = time.perf_counter() - start
        assert [d.loss_fn_inputs["ref_logprobs"].data for d in ours] == expected_refs, name
        row(
            f"remote {name} client, {n} x {args.delay * 1000:.0f} ms",
            f"SDK loop {sdk_s:6.2f} s | ours (max_concurrency=32) {ours_s:5.2f} s | "
            f"speed-up {sdk_s / ours_s:5.1f}x | results identical",
        )


# --- local torch reference -----------------------------------------------------------------------


def padded_batches(client: TorchSamplingClient, prompts: list[list[int]]) -> list[torch.Tensor]:
    """The scorer's own batches (same packing), as padded id tensors already on the device."""
    lengths = np.array([len(p) for p in prompts])
    order, plan = plan_batches(lengths, client.max_tokens_per_batch)
    batches = []
    for start, stop in plan:
        batch = order[start:stop]
        ids = torch.zeros((len(batch), lengths[batch[0]]), dtype=torch.long)
        for row, i in enumerate(batch):
            ids[row, : lengths[i]] = torch.tensor(prompts[i])
        batches.append(ids.to(client.device))
    return batches


def timed(device: torch.device, fn: Any) -> tuple[float, Any]:
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - start, result


def timed_with_peak(device: torch.device, fn: Any) -> tuple[float, Any, int]:
    """``timed(device, fn)`` and the peak memory it added: the device's allocator on CUDA, malloc on the host."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        seconds, result = timed(device, fn)
        return seconds, result, torch.cuda.max_memory_allocated(device) - base
    with PeakHostMemory() as memory:
        seconds, result = timed(device, fn)
    return seconds, result, memory.growth_bytes


def bare_forward(model: nn.Module, batches: list[torch.Tensor]) -> None:
    """The model's forward over the padded batches, nothing else: the floor of any scoring path."""
    with torch.inference_mode():
        for ids in batches:
            model(ids)


def forward_and_log_softmax(model: nn.Module, batches: list[torch.Tensor]) -> None:
    """The forward and one whole-batch float32 log-softmax (no chunks): what a plain implementation does."""
    with torch.inference_mode():
        for ids in batches:
            torch.log_softmax(model(ids)[:, :-1], dim=-1, dtype=torch.float32).gather(-1, ids[:, 1:, None])


def bench_local(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    model, prompts = build_model(args), build_prompts(args)
    packed = PackedTokens.from_sequences(prompts)
    head = TorchSamplingClient(model, device=device, dtype=args.dtype, max_tokens_per_batch=args.budget)
    budget = head.max_tokens_per_batch  # both paths cut the same batches
    general = TorchSamplingClient(model, device=device, max_tokens_per_batch=budget, output_head=False)
    tokens = packed.num_tokens
    params = sum(p.numel() for p in model.parameters())
    where = f"{args.model} model ({params / 1e6:.1f}M params, vocab {head.vocab_size}), {len(prompts)} seqs, {tokens} tokens"
    head.compute_logprobs_batch(prompts[:4])  # warm-up, and the head path's one-time check
    general.compute_logprobs_batch(prompts[:4])
    assert head.path == "output_head", head.why_not_head

    batches = padded_batches(head, prompts)
    padded = sum(b.numel() for b in batches)
    print(
        f"local: {where}; {device.type}, {str(head.dtype).removeprefix('torch.')}; budget {budget}: "
        f"{len(batches)} batches, {padded / tokens - 1:.1%} padding",
        flush=True,
    )

    variants = {
        "bare": lambda: bare_forward(model, batches),
        "naive": lambda: forward_and_log_softmax(model, batches),
        "head": lambda: head.score_packed(packed).cpu(),  # packed ids in, host float32 values out
        "general": lambda: general.score_packed(packed).cpu(),
        "lists": lambda: head.compute_logprobs_batch(prompts),  # the SDK's list form
    }
    # Interleaved rounds, best of each: the fairest figure on a machine shared with other work.
    best, results = dict.fromkeys(variants, float("inf")), {}
    for _ in range(args.repeat):
        for name, fn in variants.items():
            seconds, results[name] = timed(device, fn)
            best[name] = min(best[name], seconds)
    # The bare pass computes the same numbers: check its first batch against the scorer's rows.
    with torch.inference_mode():
        ids = batches[0]
        logp = model(ids)[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1).cpu()
    order, _ = plan_batches(packed.lengths, budget)
    rows = order[: ids.shape[0]]
    head_values = results["head"].numpy()
    diff_bare = max(
        float(np.abs(logp[r, : len(prompts[i]) - 1].numpy() - head_values[packed.offsets[i] : packed.offsets[i + 1] - 1]).max())
        for r, i in enumerate(rows)
    )
    diff_paths = float(np.abs(head_values - results["general"].numpy()).max())
    diff_lists = max_abs_diff(results["lists"], general.compute_logprobs_batch(prompts))
    tol = 1e-5 if head.dtype == torch.float32 else 0.1
    assert max(diff_bare, diff_paths, diff_lists) <= tol, (diff_bare, diff_paths, diff_lists)
    rate = {name: tokens / seconds for name, seconds in best.items()}
    row(
        f"local scorer, budget {budget}",
        f"bare forward {rate['bare']:9.0f} tok/s | output-head path {rate['head']:9.0f} tok/s "
        f"({rate['head'] / rate['bare']:.1%} of bare) | general path {rate['general']:9.0f} tok/s "
        f"({rate['general'] / rate['bare']:.1%}) | naive forward + whole-batch log-softmax {rate['naive']:.0f} tok/s "
        f"| SDK lists {rate['lists']:.0f} tok/s | max |diff| {max(diff_bare, diff_paths, diff_lists):.1e}",
    )

    budgets = args.budgets if args.budgets is not None else ([1024, 4096] if args.quick else [512, 1024, 2048, 4096, 8192, 16384])
    reference = results["lists"]
    for sweep_budget in budgets:
        if device.type == "cuda":
            result = measure_budget(args, sweep_budget, model=model)
        else:  # a fresh process per budget, so memory freed earlier cannot hide this budget's peak
            result = measure_budget_in_subprocess(args, sweep_budget)
        diff = max_abs_diff(result.pop("logprobs"), reference)
        assert diff <= tol, (sweep_budget, diff)
        row(
            f"  max_tokens_per_batch={sweep_budget}",
            f"scorer {result['tokens_per_s']:9.0f} tok/s | peak memory +{result['peak_mib']:8.1f} MiB "
            f"({result['batches']} batches) | max |diff| vs default {diff:.1e}",
        )


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    ]


def _live_heap_reader() -> Any:
    """Bytes currently allocated through malloc (glibc >= 2.33 ``mallinfo2``), or None elsewhere."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (AttributeError, OSError):
        return None
    mallinfo2.restype = _MallInfo2

    def live() -> int:
        info = mallinfo2()
        return info.uordblks + info.hblkhd

    return live


class PeakHostMemory:
    """Peak growth of host memory in use while the block runs, sampled every millisecond on a thread.

    It counts bytes allocated through malloc (torch's CPU tensors among them) with glibc's
    ``mallinfo2``, so neither memory that the allocator keeps after a free nor pages the kernel
    drops and faults back in blur it (both made resident-set figures noisy here). Without glibc it
    falls back to the growth of ``ru_maxrss``, the process's resident high-water mark.
    """

    def __enter__(self) -> PeakHostMemory:
        self.read = _live_heap_reader()
        self.method = "malloc'd bytes" if self.read is not None else "ru_maxrss growth"
        self.ru_base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        self._stop = threading.Event()
        if self.read is not None:
            self.base = self.peak = self.read()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self.read())

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stop(self) -> None:
        """End the measurement now (later allocations do not count)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self.read is not None:
            self._thread.join()
            self.peak = max(self.peak, self.read())
        else:
            self.ru_end = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    @property
    def growth_bytes(self) -> int:
        if self.read is None:
            return (getattr(self, "ru_end", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) - self.ru_base) * 1024
        return self.peak - self.base


def measure_budget(args: argparse.Namespace, budget: int, model: nn.Module | None = None) -> dict[str, Any]:
    device = torch.device(args.device)
    model = build_model(args) if model is None else model
    prompts = build_prompts(args)
    client = TorchSamplingClient(model, device=device, dtype=args.dtype, max_tokens_per_batch=budget)
    client.compute_logprobs_batch(prompts)  # warm-up: one pass fills the per-shape kernel caches
    tokens = sum(len(p) for p in prompts)
    batches = len(padded_batches(client, prompts))
    seconds, logprobs, peak = timed_with_peak(device, lambda: client.compute_logprobs_batch(prompts))
    for _ in range(args.repeat - 1):
        seconds = min(seconds, timed(device, lambda: client.compute_logprobs_batch(prompts))[0])
    return {"tokens_per_s": tokens / seconds, "peak_mib": peak / 2**20, "batches": batches, "logprobs": logprobs}


def measure_budget_in_subprocess(args: argparse.Namespace, budget: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        command = [sys.executable, __file__, "--device", args.device, "--model", args.model, "--dtype", args.dtype]
        command += ["--seed", str(args.seed), "--repeat", str(args.repeat)]
        command += ["--probe-budget", str(budget), "--probe-out", out]
        if args.quick:
            command.append("--quick")
        subprocess.run(command, check=True)
        return torch.load(out)


# --- memory of a DPO fit start, and of one batch -----------------------------------------------

FIT_MODEL = (32768, 512, 8, 8)  # vocab, width, layers, heads: 59M parameters, 237 MB of float32 weights


def fit_pairs(args: argparse.Namespace) -> list[Any]:
    """DPO pairs of 160-480 tokens sharing a 32-token prompt, as datums."""
    from loops_callbacks.data import dpo_pair_datums

    generator = torch.Generator().manual_seed(args.seed + 2)
    vocab = FIT_MODEL[0]
    data = []
    for _ in range(8 if args.quick else 24):
        prompt = torch.randint(0, vocab, (32,), generator=generator).tolist()
        chosen, rejected = (
            prompt + torch.randint(0, vocab, (int(torch.randint(128, 448, (), generator=generator)),), generator=generator).tolist()
            for _ in range(2)
        )
        data.extend(dpo_pair_datums(chosen, rejected, prompt_length=32))
    return data


def probe_fit(args: argparse.Namespace, variant: str, cache_dir: str) -> dict[str, Any]:
    """Peak growth of host memory from ``trainer.fit`` until ``on_train_start`` (the reference is ready)."""
    import logging
    import warnings

    import lightning as L

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    from loops_callbacks.data import DPODataModule, Scoring

    class FitLM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(args.seed)
            self.net = BenchLM(*FIT_MODEL)

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.net(input_ids)

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            logprobs = torch.log_softmax(self(batch["input_ids"]), -1).gather(-1, batch["target_tokens"][..., None])
            delta = ((logprobs.squeeze(-1) - batch["ref_logprobs"]) * batch["weights"]).sum(-1)
            return -F.logsigmoid(0.1 * (delta[0::2] - delta[1::2])).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    class AtTrainStart(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            memory.stop()
            trainer.should_stop = True

    model = FitLM()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    reference = model.net if variant == "snapshot" else None  # an nn.Module: a frozen deep copy
    datamodule = DPODataModule(
        fit_pairs(args), batch_size=2, reference=reference, cache_dir=cache_dir, use_cache=variant != "snapshot",
        progress=False, scoring=Scoring(max_tokens_per_batch=args.budget),
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[AtTrainStart()],
        default_root_dir=cache_dir,
    )
    import gc

    gc.collect()
    with PeakHostMemory() as memory:
        start = time.perf_counter()
        trainer.fit(model, datamodule=datamodule)
    report = datamodule.reference_report
    return {
        "peak_mib": memory.growth_bytes / 2**20,
        "weight_mib": weight_bytes / 2**20,
        "seconds": time.perf_counter() - start,
        "source": report.source if report else None,
        "method": memory.method,
    }


def bench_fit_memory(args: argparse.Namespace) -> None:
    """Each variant in a fresh process: the default reference, the same run given a ready cache, a snapshot."""
    vocab, width, layers, _ = FIT_MODEL
    with tempfile.TemporaryDirectory() as cache_dir:
        results = {variant: run_probe(args, "--probe-fit", variant, cache_dir) for variant in ("default", "cache", "snapshot")}
    weights = results["default"]["weight_mib"]
    assert results["default"]["source"] == "scored" and results["cache"]["source"] == "cache"
    print(
        f"DPO fit start on the CPU (a {weights:.0f} MiB model: vocab {vocab}, width {width}, {layers} layers; "
        f"peak growth of {results['default']['method']} from fit() to on_train_start, a fresh process each):",
        flush=True,
    )
    for variant, label in (
        ("default", "default reference (the policy itself)"),
        ("cache", "same run given a ready cache"),
        ("snapshot", "reference=<the module> (a frozen copy, the old default)"),
    ):
        result = results[variant]
        row(f"  {label}", f"+{result['peak_mib']:7.1f} MiB ({result['peak_mib'] / weights:6.1%} of the weights) in {result['seconds']:.1f} s")
    extra = results["default"]["peak_mib"] - results["cache"]["peak_mib"]
    row("  default - cache", f"{extra:+7.1f} MiB = {extra / weights:.1%} of the weight bytes (target <= 25%)")


def probe_head_memory(args: argparse.Namespace, path: str) -> dict[str, Any]:
    """Peak extra memory of scoring one batch of ``--budget`` tokens, vocabulary 131072, on one path."""
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    vocab, width = 131072, 256
    model = BenchLM(vocab, width, 1, 4, max_len=1024).eval().requires_grad_(False)
    budget = args.budget or 8192
    client = TorchSamplingClient(model, device=device, dtype=args.dtype, max_tokens_per_batch=budget, output_head=path == "output_head")
    generator = torch.Generator().manual_seed(args.seed + 3)
    rows = budget // 512
    packed = PackedTokens.from_sequences(torch.randint(0, vocab, (rows, 512), generator=generator).numpy())
    client.score_packed(packed.slice(0, 1)).cpu()  # warm-up, and the head path's one-time check
    assert client.path == path, client.why_not_head
    seconds, values, peak = timed_with_peak(device, lambda: client.score_packed(packed))
    return {"peak_mib": peak / 2**20, "seconds": seconds, "values": values.cpu().numpy(), "tokens": packed.num_tokens}


def bench_head_memory(args: argparse.Namespace) -> None:
    results = {
        path: run_probe(args, "--probe-head", path, "") if args.device == "cpu" else probe_head_memory(args, path)
        for path in ("logits", "output_head")
    }
    diff = float(np.abs(results["logits"].pop("values") - results["output_head"].pop("values")).max())
    tol = 1e-4 if args.dtype == "float32" else 0.1
    assert diff <= tol, diff
    tokens = results["logits"]["tokens"]
    print(f"one batch of {tokens} tokens, vocabulary 131072, {args.device}, {args.dtype}: peak extra memory while scoring")
    for path, label in (("logits", "general path (the model's logits)"), ("output_head", "output-head path (row chunks)")):
        result = results[path]
        row(f"  {label}", f"+{result['peak_mib']:8.1f} MiB | {tokens / result['seconds']:8.0f} tok/s")
    row("  ratio", f"{results['logits']['peak_mib'] / max(results['output_head']['peak_mib'], 1e-9):.0f}x less | max |diff| {diff:.1e}")


def run_probe(args: argparse.Namespace, flag: str, variant: str, cache_dir: str) -> dict[str, Any]:
    """One measurement in a fresh process (memory freed by an earlier one cannot hide its peak)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        command = [sys.executable, __file__, "--device", args.device, "--dtype", args.dtype, "--seed", str(args.seed)]
        command += [flag, variant, "--probe-dir", cache_dir, "--probe-out", out]
        if args.budget is not None:
            command += ["--budget", str(args.budget)]
        if args.quick:
            command.append("--quick")
        subprocess.run(command, check=True)
        return torch.load(out, weights_only=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default: cpu)")
    parser.add_argument("--model", default="small", choices=sorted(MODELS))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--budget", type=int, default=None, help="max_tokens_per_batch (default: the device's)")
    parser.add_argument("--budgets", type=int, nargs="*", default=None, help="budgets to sweep")
    parser.add_argument("--delay", type=float, default=0.05, help="seconds per remote call")
    parser.add_argument("--quick", action="store_true", help="reduced sizes: a smoke test")
    parser.add_argument("--skip-remote", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=None, help="timed rounds, the best is reported (3; 1 with --quick)")
    parser.add_argument("--fit-memory", action="store_true", help="peak memory of a DPO fit start (CPU), then stop")
    parser.add_argument("--head-memory", action="store_true", help="peak memory of one 128k-vocabulary batch, then stop")
    parser.add_argument("--probe-budget", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--probe-fit", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--probe-head", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--probe-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--probe-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeat is None:
        args.repeat = 1 if args.quick else 3
    if args.probe_budget is not None:
        torch.save(measure_budget(args, args.probe_budget), args.probe_out)
        return
    if args.probe_fit is not None:
        torch.save(probe_fit(args, args.probe_fit, args.probe_dir), args.probe_out)
        return
    if args.probe_head is not None:
        torch.save(probe_head_memory(args, args.probe_head), args.probe_out)
        return
    if args.fit_memory or args.head_memory:
        if args.fit_memory:
            bench_fit_memory(args)
        if args.head_memory:
            bench_head_memory(args)
        return

    load = ", load average {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()) if hasattr(os, "getloadavg") else ""
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads{load}, default budgets {_DEFAULT_TOKENS_PER_BATCH}")
    if args.device.startswith("cuda"):
        print(f"device: {torch.cuda.get_device_name(torch.device(args.device))}")
    total = time.perf_counter()
    if not args.skip_remote:
        bench_remote(args)
    bench_local(args)
    print(json.dumps({"total_s": round(time.perf_counter() - total, 1), "load_average": os.getloadavg()}))


if __name__ == "__main__":
    main()
