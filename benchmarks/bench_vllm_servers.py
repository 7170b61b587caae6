"""A fleet of vLLM servers (``VLLMServerFleet``): a weight sync's time by phase, and rollout throughput with one
server and with two.

Starts two vLLM servers on this machine on the checkpoint (``LocalVLLMServers``, float32, dev mode), or
uses ``--servers`` already running on it. Then:

* ``--syncs`` syncs of the checkpoint's weights (moved a little each time) to both servers at once
  (path transport, prefix-cache reset): per phase, the median over the syncs of the slowest server,
  the trainer's write of the safetensors, and the whole sync;
* rollouts: ``--prompts`` prompts of 16 random tokens, ``--n`` completions of ``--max-tokens`` tokens
  each (no stop token: every completion is ``--max-tokens`` long), from the first server alone, then
  from both; best of ``--repeats`` (tokens sampled per second of wall time).

    python benchmarks/bench_vllm_servers.py --model tiny                     # the tests' tiny Llama
    python benchmarks/bench_vllm_servers.py --model smollm2 --cache-dir /tmp/rm_cache   # SmolLM2-135M, float32
    python benchmarks/bench_vllm_servers.py --model tiny --syncs 2 --prompts 4 --max-tokens 4 --repeats 1  # smoke

On a machine with as many cores as servers want, two servers sample about twice as fast as one; on a
2-core machine they share the cores. Needs vLLM; run with OMP_NUM_THREADS=1. Writes only in a
temporary directory (and ``--cache-dir``, the checkpoint's).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))

from machine import cpu_name  # noqa: E402

from loops_callbacks.integrations.vllm import LocalVLLMServers, VLLMServerFleet  # noqa: E402
from loops_callbacks.integrations.vllm.fleet import SYNC_PHASES  # noqa: E402

SMOLLM2 = "smollm2-135m-instruct-f32"


def tiny_llama(directory: Path) -> Path:
    """The tests' tiny Llama (hidden 128, 2 layers, 512-token word-level vocabulary), built from a config."""
    import tokenizers
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, bos_token_id=0, eos_token_id=1,
        tie_word_embeddings=False,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(512)}, unk_token="t2"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=words, bos_token="t0", eos_token="t1",
                                         unk_token="t2").save_pretrained(directory)
    return directory


def measure(urls: Sequence[str], model: Any, *, syncs: int, prompts: int, n: int, max_tokens: int, repeats: int,
            weights_dir: str, vocab: int) -> dict[str, Any]:
    """The figures on running servers ``urls`` (two or more) serving ``model``'s checkpoint."""
    fleet = VLLMServerFleet(list(urls[:2]), weights_dir=weights_dir)
    trainer = copy.deepcopy(model)
    reports = []
    generator = torch.Generator().manual_seed(0)
    for version in range(1, syncs + 1):
        with torch.no_grad():
            for parameter in trainer.parameters():
                parameter.add_(1e-3 * parameter.std() * torch.randn(parameter.shape, generator=generator))
        fleet.push(trainer, version=version)
        reports.append(fleet.last_sync)
    phases = {phase: statistics.median(r.slowest()[phase] for r in reports) for phase in SYNC_PHASES}
    phases["write"] = statistics.median(r.write_seconds for r in reports)
    phases["whole sync"] = statistics.median(r.seconds for r in reports)
    ids = torch.randint(3, vocab, (prompts, 16), generator=generator).tolist()
    throughput = {}
    for count in (1, 2):
        sub = VLLMServerFleet(list(urls[:count]), weights_dir=weights_dir, prompts_per_request=max(1, prompts // 4))
        sub.push(trainer, version=syncs + 1)
        best = 0.0
        for _ in range(repeats):
            began = time.perf_counter()
            batch = sub.rollouts(ids, max_tokens=max_tokens, n=n, ignore_eos=True)
            seconds = time.perf_counter() - began
            best = max(best, float(batch["mask"].sum()) / seconds)
        throughput[count] = best
        sub.close()
    fleet.close()
    return {"phases": phases, "throughput": throughput, "syncs": syncs}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--cache-dir", default=os.environ.get("LOOPS_CALLBACKS_CACHE", "/tmp/rm_cache"))
    parser.add_argument("--servers", nargs="*", default=None, help="two running servers on the checkpoint")
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    import transformers
    import vllm

    print(f"CPU: {cpu_name()}; vllm {vllm.__version__}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory(prefix="bench_vllm_servers_") as work:
        if args.model == "tiny":
            checkpoint = tiny_llama(Path(work) / "tiny_llama")
            label = "tiny Llama (hidden 128, 2 layers)"
        else:
            checkpoint = Path(args.cache_dir) / SMOLLM2
            if not (checkpoint / "config.json").is_file():
                raise SystemExit(f"{checkpoint} is missing: python benchmarks/real_model.py --cache-dir {args.cache_dir}")
            label = "SmolLM2-135M-Instruct, float32"
        model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        print(f"model: {label}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
              f"{sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20:.1f} MiB sent per sync")
        servers = None
        urls = args.servers
        if not urls:
            began = time.perf_counter()
            servers = LocalVLLMServers(checkpoint, count=2, workdir=Path(work) / "servers", start_timeout=900)
            urls = servers.start()
            print(f"two servers started in {time.perf_counter() - began:.0f} s")
        try:
            figures = measure(urls, model, syncs=args.syncs, prompts=args.prompts, n=args.n,
                              max_tokens=args.max_tokens, repeats=args.repeats,
                              weights_dir=str(Path(work) / "weights"), vocab=model.config.vocab_size)
        finally:
            if servers is not None:
                servers.stop()
    print_figures(figures, args)


def print_figures(figures: dict[str, Any], args: argparse.Namespace) -> None:
    """The figures as two Markdown tables."""
    print(f"\nA sync to two servers at once (median of {figures['syncs']}, the slowest server per phase):")
    print("| phase | ms |\n|---|---:|")
    for phase, seconds in figures["phases"].items():
        print(f"| {phase} | {1e3 * seconds:.1f} |")
    print(f"\nRollouts: {args.prompts} prompts x n={args.n} x {args.max_tokens} tokens (best of {args.repeats}):")
    print("| servers | tokens/s |\n|---:|---:|")
    for count, rate in figures["throughput"].items():
        print(f"| {count} | {rate:.0f} |")

if __name__ == "__main__":
    main()
