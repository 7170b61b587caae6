"""Write ``trl_correction_golden.json``: TRL 1.16's IS corrections, for ``tests/correction/test_correction_golden.py``.

Run with TRL installed (not a dependency of this package), from the repository root::

    python -m venv /tmp/trl-venv && /tmp/trl-venv/bin/pip install torch==2.13.0 trl==1.16.0
    /tmp/trl-venv/bin/python tests/golden/make_trl_correction_golden.py

What runs is TRL's own code:

* the four ``vllm_importance_sampling_mode`` modes are inlined in
  ``GRPOTrainer._generate_and_score_completions`` (trl/trainer/grpo_trainer.py of trl 1.16.0,
  lines 2661-2704; the unknown-mode ``else: raise`` of lines 2705-2708 left out), so
  ``trl_importance_sampling_ratio`` below is those lines copied verbatim, with
  ``self.vllm_importance_sampling_*`` read from the arguments; the script checks, before it runs,
  that the installed file still contains each copied line;
* the off-policy sequence mask is TRL's ``GRPOTrainer.get_off_policy_mask`` (a staticmethod),
  imported and called.

Inputs are fixed (a seeded generator): float32 ``[8, 16]`` trainer and sampler logprobs, right
padding (garbage, NaN included, past each row's length), one row with an empty mask, NaN sampler
logprobs inside the mask, and per-row gaps from 1e-4 to 1 nat so that masks and clips both occur.
NaN is written as null. Only this file imports TRL (inside ``main``).
"""

from __future__ import annotations

import inspect
import json
import math
import os
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "tests", "golden", "trl_correction_golden.json")
SEED = 20
MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
CLIPS = ((None, 3.0), (0.5, 2.0), (0.8, None))  # (clip_min, clip_max): TRL's default, two-sided, lower only
OFF_POLICY_THRESHOLDS = (0.0, 0.01, 0.5)


def make_inputs() -> dict[str, Any]:
    """Fixed trainer / sampler logprobs, mask and advantages (tensors, float32)."""
    import torch

    generator = torch.Generator().manual_seed(SEED)
    batch, width = 8, 16
    lengths = torch.tensor([16, 16, 12, 9, 16, 5, 0, 14])  # row 6: an empty mask
    scales = torch.tensor([1e-4, 1e-3, 0.02, 0.1, 0.3, 1.0, 0.3, 0.05])  # the row's sampler-trainer gap
    trainer = -torch.rand(batch, width, generator=generator) * 4.0
    gap = torch.randn(batch, width, generator=generator) * scales[:, None]
    sampler = trainer - gap
    sampler[3, 2] = float("nan")  # sampler could not score these tokens (inside the mask)
    sampler[4, 7] = float("nan")
    trainer[4, 10] = trainer[4, 10] - 3.0  # one outlier token per direction
    trainer[7, 3] = trainer[7, 3] + 2.5
    mask = (torch.arange(width)[None, :] < lengths[:, None]).to(torch.float32)
    padding = mask == 0
    trainer = torch.where(padding, torch.full_like(trainer, -7.0), trainer)
    sampler = torch.where(padding, torch.full_like(sampler, float("nan")), sampler)  # padding is never read
    advantages = torch.tensor([[1.0], [-1.0], [-0.5], [-2.0], [-1.0], [-1.0], [0.5], [0.0]])
    return {"trainer": trainer, "sampler": sampler, "mask": mask, "advantages": advantages}


def trl_importance_sampling_ratio(
    old_per_token_logps: Any, sampling_per_token_logps: Any, completion_mask: Any,
    vllm_importance_sampling_mode: str, clip_min: float | None, clip_max: float | None,
) -> tuple[Any, Any]:
    """TRL 1.16.0 grpo_trainer.py lines 2661-2704, verbatim but for ``self.`` and the tool mask (None here).

    Returns the ratio (``[B, T]`` for token modes, ``[B, 1]`` for sequence modes) and, for mask
    modes, TRL's ``invalid_mis_mask`` (None for truncate modes).
    """
    import torch

    tool_mask = None
    invalid_mis_mask = None
    # ---- copied from trl/trainer/grpo_trainer.py (trl 1.16.0), lines 2661-2704 ----
    mask = completion_mask if tool_mask is None else completion_mask * tool_mask
    per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask
    # Tokens whose sampling logprob was NaN (unavailable from vLLM) get a zero difference, so their
    # importance ratio is exactly 1 (no correction) rather than propagating NaN through the loss.
    per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)

    sequence_level_is = vllm_importance_sampling_mode in ["sequence_mask", "sequence_truncate"]
    if sequence_level_is:
        per_sequence_logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
        logps_diff = per_sequence_logps_diff
    else:
        logps_diff = per_token_logps_diff

    vllm_importance_sampling_ratio = torch.exp(logps_diff)

    if vllm_importance_sampling_mode in ["sequence_truncate", "token_truncate"]:
        vllm_importance_sampling_ratio = torch.clamp(
            vllm_importance_sampling_ratio,
            min=clip_min,
            max=clip_max,
        )
    elif vllm_importance_sampling_mode in ["sequence_mask", "token_mask"]:
        min_val = (
            clip_min
            if clip_min is not None
            else -math.inf
        )
        max_val = (
            clip_max
            if clip_max is not None
            else math.inf
        )

        invalid_mis_mask = (vllm_importance_sampling_ratio < min_val) | (
            vllm_importance_sampling_ratio > max_val
        )
        vllm_importance_sampling_ratio = vllm_importance_sampling_ratio.masked_fill(
            invalid_mis_mask, value=0.0
        )
    # ---- end of the copy ----
    return vllm_importance_sampling_ratio, invalid_mis_mask


COPIED_LINES = (  # lines of the copy that must appear in the installed TRL file (with self.)
    "per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask",
    "per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)",
    'sequence_level_is = self.vllm_importance_sampling_mode in ["sequence_mask", "sequence_truncate"]',
    "per_sequence_logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)",
    "vllm_importance_sampling_ratio = torch.exp(logps_diff)",
    "min=self.vllm_importance_sampling_clip_min,",
    "max=self.vllm_importance_sampling_clip_max,",
    "invalid_mis_mask = (vllm_importance_sampling_ratio < min_val) | (",
    "invalid_mis_mask, value=0.0",
)


def rows(tensor: Any) -> list:
    """Nested lists with NaN as None (strict JSON)."""
    return [[None if math.isnan(v) else v for v in row] for row in tensor.tolist()]


def main() -> None:
    import torch
    import trl
    from trl.trainer import grpo_trainer
    from trl.trainer.grpo_trainer import GRPOTrainer

    source = inspect.getsource(grpo_trainer)
    missing = [line for line in COPIED_LINES if line not in source]
    if missing:
        sys.exit(f"TRL {trl.__version__}'s grpo_trainer.py no longer has the copied lines {missing}; re-copy them")
    inputs = make_inputs()
    golden: dict[str, Any] = {
        "how": "tests/golden/make_trl_correction_golden.py",
        "versions": {"trl": trl.__version__, "torch": torch.__version__, "python": sys.version.split()[0]},
        "inputs": {
            "trainer": rows(inputs["trainer"]),
            "sampler": rows(inputs["sampler"]),
            "mask": inputs["mask"].tolist(),
            "advantages": inputs["advantages"].reshape(-1).tolist(),
        },
        "importance_sampling": [],
        "off_policy_mask": [],
    }
    for mode in MODES:
        for clip_min, clip_max in CLIPS:
            ratio, invalid = trl_importance_sampling_ratio(
                inputs["trainer"], inputs["sampler"], inputs["mask"], mode, clip_min, clip_max
            )
            golden["importance_sampling"].append({
                "mode": mode, "clip_min": clip_min, "clip_max": clip_max,
                "ratio": rows(ratio),  # [B, T] or [B, 1]
                "invalid": None if invalid is None else invalid.tolist(),
            })
    for threshold in OFF_POLICY_THRESHOLDS:
        keep = GRPOTrainer.get_off_policy_mask(
            advantages=inputs["advantages"], per_token_logps=inputs["trainer"],
            sampling_per_token_logps=inputs["sampler"], mask=inputs["mask"], off_policy_threshold=threshold,
        )
        golden["off_policy_mask"].append({"threshold": threshold, "keep": keep.reshape(-1).tolist()})
    with open(OUT, "w", encoding="utf-8") as file:
        json.dump(golden, file, separators=(",", ":"))
        file.write("\n")
    print(f"wrote {OUT}: {len(golden['importance_sampling'])} IS cases, "
          f"{len(golden['off_policy_mask'])} off-policy masks")


if __name__ == "__main__":
    main()
