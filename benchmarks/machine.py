"""The machine a benchmark ran on, for the first line of its output.

Example:
    >>> cpu_name().count("cores") == 1
    True
"""

from __future__ import annotations

import os
import platform


def cpu_name() -> str:
    """The CPU's model name, its bf16 instructions where the kernel lists them, and the core count.

    E.g. ``"Intel(R) Xeon(R) Processor, avx512_bf16 amx_bf16, 2 cores"``; a CPU without native
    bf16 (AVX2 only) runs bf16 matmuls emulated, many times slower, so the figures depend on it.
    """
    try:
        with open("/proc/cpuinfo") as handle:
            info = handle.read()
    except OSError:
        return f"{platform.processor() or 'unknown CPU'}, {os.cpu_count()} cores"
    lines = info.splitlines()
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown CPU")
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    bf16 = [flag for flag in ("avx512_bf16", "amx_bf16") if flag in flags] or ["no native bf16"]
    return f"{model}, {' '.join(bf16)}, {os.cpu_count()} cores"
