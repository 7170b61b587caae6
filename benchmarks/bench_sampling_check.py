"""The check of what was sampled: false alarms on honest samplers, detections of mis-drawn tokens, its cost.

Each logged step is 128 sequences x 64 sampled tokens, drawn by a sampler engine from a tiny
random-init Hugging Face Llama (its output layer scaled so that distributions are as peaked as a
trained model's), whose logprobs are reported raw (the model's own distribution at temperature 1,
vLLM's default ``logprobs_mode``); the trainer is the same weights in float32, scoring the sampled
sequences with ``token_logprobs(with_entropy=True)``. ``sampling_z`` and the rest come from the
monitor's own statistics (``DivergenceStats`` and ``metrics.sampling_metrics``).

Engines: ``hf`` (``generate(do_sample=True)`` on a float32 or bf16 copy) and, when vLLM imports,
``vllm`` (an in-process ``LLM`` of the same weights, float32 or bfloat16). Settings: honest (temperature
1, no truncation) and drawn otherwise while the raw logprobs are reported: temperature 0.7, 0.9, 1.2,
top-p 0.9 and 0.95.

Two sets share the code and nothing else: ``threshold`` (the model seed and vocabulary the default
threshold ``diagnosis.SAMPLING_Z`` was checked on) and ``evaluation`` (another seed, vocabulary and
prompt length), reported separately. ``--cost`` measures the extra vocabulary pass on an HF model with
a 128k vocabulary: a training step with and without ``with_entropy``, side by side, and its share of a
step averaged over the default logging interval (50).

    python benchmarks/bench_sampling_check.py --set evaluation --healthy-steps 1000
    python benchmarks/bench_sampling_check.py --cost
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_name  # noqa: E402

from loops_callbacks import token_logprobs  # noqa: E402
from loops_callbacks.divergence.batch import flatten_padded  # noqa: E402
from loops_callbacks.divergence.diagnosis import SAMPLING_Z  # noqa: E402
from loops_callbacks.divergence.statistics import held_sampling_z, sampling_metrics  # noqa: E402
from loops_callbacks.divergence.statistics import DivergenceStats  # noqa: E402

SHAPE = {"sequences": 128, "tokens": 64}  # a logged step (smaller with --sequences / --tokens, for a smoke run)
SETTINGS = {  # name: (temperature, top_p)
    "honest": (1.0, 1.0),
    "raw logprobs, T 0.7": (0.7, 1.0),
    "raw logprobs, T 0.9": (0.9, 1.0),
    "raw logprobs, T 1.2": (1.2, 1.0),
    "raw logprobs, top-p 0.9": (1.0, 0.9),
    "raw logprobs, top-p 0.95": (1.0, 0.95),
}


@dataclass(frozen=True)
class SamplingSet:
    seed: int
    vocab: int
    prompt_length: int
    sharpness: float  # the output layer's scale


SETS = {
    "threshold": SamplingSet(seed=0, vocab=512, prompt_length=8, sharpness=8.0),
    "evaluation": SamplingSet(seed=1, vocab=1024, prompt_length=12, sharpness=6.0),
}


def new_model(sampling_set: SamplingSet) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(sampling_set.seed)
    config = LlamaConfig(
        vocab_size=sampling_set.vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=1,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sampling_set.sharpness)
    return model


def check(sequences: torch.Tensor, raw: torch.Tensor, trainer_model: torch.nn.Module, prompt: int) -> dict[str, float]:
    """The monitor's sampling metrics of one step: ``sequences`` [B, P + C], ``raw`` the sampler's raw logprobs."""
    input_ids, targets = sequences[:, :-1], sequences[:, 1:]
    with torch.no_grad():
        scored = token_logprobs(trainer_model(input_ids).logits, targets, with_entropy=True)
    sampler = torch.zeros(targets.shape)
    sampler[:, prompt - 1 :] = raw
    mask = torch.zeros(targets.shape)
    mask[:, prompt - 1 :] = 1.0
    flat = flatten_padded(sampler_logprobs=sampler, training_logprobs=scored.logprobs, mask=mask,
                          training_entropy=scored.entropy, training_varentropy=scored.varentropy)
    host = DivergenceStats.from_batch(flat).to_host()
    return sampling_metrics(host.totals, host.extrema)


def hf_steps(sampling_set: SamplingSet, dtype: str, setting: str, steps: int, seed: int):
    """Each step's metrics, the sampler an HF ``generate`` on a ``dtype`` copy of the weights."""
    trainer_model = new_model(sampling_set)
    sampler = new_model(sampling_set).to(getattr(torch, dtype))
    temperature, top_p = SETTINGS[setting]
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        prompts = torch.randint(2, sampling_set.vocab, (SHAPE["sequences"], sampling_set.prompt_length),
                                generator=generator)
        torch.manual_seed(seed * 100_003 + step)
        with torch.no_grad():
            out = sampler.generate(
                prompts, attention_mask=torch.ones_like(prompts), do_sample=True, top_k=0, top_p=top_p,
                temperature=temperature, max_new_tokens=SHAPE["tokens"], min_new_tokens=SHAPE["tokens"],
                eos_token_id=None,
                pad_token_id=0, output_logits=True, return_dict_in_generate=True,
            )
        completion = out.sequences[:, sampling_set.prompt_length :]
        raw = torch.log_softmax(torch.stack(out.logits, 1).float(), -1).gather(-1, completion[..., None])[..., 0]
        yield check(out.sequences, raw, trainer_model, sampling_set.prompt_length)


def vllm_steps(sampling_set: SamplingSet, dtype: str, setting: str, steps: int, seed: int, workdir: Path):
    """Each step's metrics, the sampler an in-process vLLM engine of the same weights (raw logprobs)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    trainer_model = new_model(sampling_set)
    folder = workdir / f"llama-{sampling_set.seed}"
    if not (folder / "config.json").exists():
        trainer_model.save_pretrained(folder)
        _word_level_tokenizer(sampling_set.vocab).save_pretrained(folder)
    engine = _engines.get((folder, dtype))
    if engine is None:
        engine = LLM(model=str(folder), dtype=dtype, enforce_eager=True,
                     gpu_memory_utilization=0.05, max_model_len=256, seed=seed, logprobs_mode="raw_logprobs")
        _engines[(folder, dtype)] = engine
    temperature, top_p = SETTINGS[setting]
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=SHAPE["tokens"], min_tokens=SHAPE["tokens"],
                            ignore_eos=True, logprobs=0, detokenize=False)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        prompts = torch.randint(2, sampling_set.vocab, (SHAPE["sequences"], sampling_set.prompt_length),
                                generator=generator)
        outputs = engine.generate([{"prompt_token_ids": p} for p in prompts.tolist()], params, use_tqdm=False)
        ids = torch.tensor([list(o.outputs[0].token_ids) for o in outputs])
        raw = torch.tensor([[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                            for o in outputs])
        yield check(torch.cat([prompts, ids], 1), raw, trainer_model, sampling_set.prompt_length)


_engines: dict = {}


def _word_level_tokenizer(vocab: int):
    """A tokenizer of ``vocab`` words ``t0`` ... for the engine's checkpoint (it never reads text here)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    word_level = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t2"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=word_level, bos_token="t0", eos_token="t1", unk_token="t2")


def table(which: str, engines: list[str], healthy_steps: int, fault_steps: int, workdir: Path,
          dtypes: tuple[str, ...] = ("float32", "bfloat16")) -> None:
    sampling_set = SETS[which]
    print(f"\nSet {which!r}: {sampling_set}; {SHAPE['sequences']} sequences x {SHAPE['tokens']} tokens a step; "
          f"alarm at |sampling_z| >= {SAMPLING_Z:g} with and without its most extreme token\n")
    print("| engine | sampler | drawn | steps | alarms | median z | z range | median T_eff | median rel. bias |")
    print("|---|---|---|---:|---:|---:|---|---:|---:|")
    for engine in engines:
        for dtype in dtypes:
            for setting in SETTINGS:
                steps = healthy_steps if setting == "honest" else fault_steps
                if not steps:
                    continue
                make = hf_steps if engine == "hf" else vllm_steps
                args = (workdir,) if engine == "vllm" else ()
                found = list(make(sampling_set, dtype, setting, steps, sampling_set.seed + 17, *args))
                zs = [f["sampling_z"] for f in found]
                alarms = sum(abs(held_sampling_z(f)) >= SAMPLING_Z for f in found)  # the diagnosis' rule
                print(
                    f"| {engine} | {dtype} | {setting} | {len(found)} | {alarms} | {statistics.median(zs):.3g} | "
                    f"{min(zs):.3g} to {max(zs):.3g} | "
                    f"{statistics.median(f['sampling_temperature'] for f in found):.3g} | "
                    f"{statistics.median(f['sampling_relative_bias'] for f in found):.3g} |",
                    flush=True,
                )


def cost(repeats: int) -> None:
    """A training step of an HF Llama with a 128k vocabulary, with and without the entropy pass, side by side."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    vocab = 128_256
    for hidden, layers in ((256, 2), (512, 8)):
        config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                             num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                             max_position_embeddings=512)
        model = LlamaForCausalLM(config)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        ids = torch.randint(0, vocab, (2, 257))

        def step(with_entropy: bool) -> float:
            start = time.perf_counter()
            scored = token_logprobs(model(ids[:, :-1]).logits, ids[:, 1:], with_entropy=with_entropy)
            logprobs = scored.logprobs if with_entropy else scored
            (-logprobs.mean()).backward()
            optimizer.step()
            optimizer.zero_grad()
            return time.perf_counter() - start

        step(False)
        times = {False: [], True: []}
        for _ in range(repeats):  # alternated, so the machine's load falls on both alike
            for with_entropy in (False, True):
                times[with_entropy].append(step(with_entropy))
        plain, extra = statistics.median(times[False]), statistics.median(times[True]) - statistics.median(times[False])
        print(f"Llama hidden {hidden} x {layers} layers, vocab {vocab}, 2 x 256 tokens: step {plain:.3f} s; "
              f"the entropy pass +{extra:.3f} s ({extra / plain:.1%} of a step; on logged steps only, "
              f"{extra / plain / 50:.2%} of a step averaged over log_every_n_steps = 50)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", choices=sorted(SETS), default="evaluation")
    parser.add_argument("--engine", choices=("hf", "vllm", "both"), default="hf")
    parser.add_argument("--healthy-steps", type=int, default=200)
    parser.add_argument("--fault-steps", type=int, default=10)
    parser.add_argument("--sequences", type=int, default=SHAPE["sequences"])
    parser.add_argument("--tokens", type=int, default=SHAPE["tokens"])
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "both"), default="both", help="the sampler's")
    parser.add_argument("--cost", action="store_true", help="measure the entropy pass instead")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workdir", default="/tmp/bench_sampling_check", help="where the vLLM model is written")
    args = parser.parse_args()
    SHAPE.update(sequences=args.sequences, tokens=args.tokens)
    torch.set_num_threads(1)
    print(f"CPU: {cpu_name()}")
    if args.cost:
        cost(args.repeats)
        return
    engines = ["hf", "vllm"] if args.engine == "both" else [args.engine]
    dtypes = ("float32", "bfloat16") if args.dtype == "both" else (args.dtype,)
    table(args.set, engines, args.healthy_steps, args.fault_steps, Path(args.workdir), dtypes)


if __name__ == "__main__":
    main()
