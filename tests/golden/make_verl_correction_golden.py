"""Write ``verl_correction_golden.json``: verl's rollout-correction weights and rejection masks, for the golden tests.

Run from the repository root with a verl source tree at commit
b178a3cd56f58b2d502255daba591e92833930a7 (verl is not a dependency, and is not installed: only
two of its files are read)::

    git clone https://github.com/volcengine/verl /tmp/verl
    git -C /tmp/verl checkout b178a3cd56f58b2d502255daba591e92833930a7
    python tests/golden/make_verl_correction_golden.py /tmp/verl

What runs is verl's own code, unchanged: ``verl/trainer/ppo/rollout_corr_helper.py``
(``compute_rollout_correction_weights`` for truncated IS, ``compute_rollout_rejection_mask`` for
rejection) and the ``masked_sum`` / ``masked_mean`` of ``verl/utils/torch_functional.py`` it calls.
Both files are executed as modules; the imports they make that these functions never use
(``tensordict``, ``verl.protocol``, verl's config classes and device helpers) are empty
placeholders. The script refuses files whose sha256 differs from the commit's.

Inputs are those of ``make_trl_correction_golden.py`` (seeded) in two forms: ``finite`` (every NaN
sampler logprob replaced by the trainer's, so log ratio 0) and ``nan`` (NaN sampler logprobs in
the mask and in the padding). NaN is written as null.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
import types
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "tests", "golden", "verl_correction_golden.json")
COMMIT = "b178a3cd56f58b2d502255daba591e92833930a7"
FILES = {  # path in verl -> sha256 at COMMIT
    "verl/utils/torch_functional.py": "8ac62195a800ba784d1cddf03ee0bc7627f20236cc11e135fdba20e8d4a01f14",
    "verl/trainer/ppo/rollout_corr_helper.py": "d7c584d1c3f2fd31e4c2e508e32a7a54b12b94284cd441f1f1c7889f5258c304",
}
IS_CASES = (("token", 2.0), ("sequence", 2.0), ("token", 1.5), ("sequence", 5.0))
RS_CASES = (
    ("token_k1", "2.0"), ("token_k1", "0.5_1.5"), ("token_k2", 0.1), ("token_k3", 0.05),
    ("seq_sum_k1", "0.5_2.0"), ("seq_sum_k2", 1.0), ("seq_sum_k3", 0.5),
    ("seq_mean_k1", "0.999_1.001"), ("seq_mean_k1", "0.9_1.1"), ("seq_mean_k2", 0.01), ("seq_mean_k3", 0.01),
    ("seq_max_k2", 0.5), ("seq_max_k3", 0.5),
)


def load_verl(verl_root: str) -> types.ModuleType:
    """``rollout_corr_helper`` executed from ``verl_root``, its unused imports as placeholders."""
    for path, expected in FILES.items():
        with open(os.path.join(verl_root, path), "rb") as file:
            digest = hashlib.sha256(file.read()).hexdigest()
        if digest != expected:
            sys.exit(f"{path} has sha256 {digest}, not that of verl {COMMIT} ({expected}); check out that commit")

    class Placeholder:
        """A name the loaded files import but the called functions never use."""

    def stub(name: str, **names: Any) -> None:
        module = types.ModuleType(name)
        module.__dict__.update(names)
        sys.modules[name] = module

    for package in ("verl", "verl.utils", "verl.trainer", "verl.trainer.ppo", "verl.trainer.config", "verl.workers",
                    "verl.workers.config"):
        stub(package, __path__=[])
    stub("tensordict", TensorDict=Placeholder)
    stub("verl.utils.device", get_device_name=lambda: "cpu", get_torch_device=lambda: None)
    stub("verl.protocol", DataProto=Placeholder)
    stub("verl.trainer.config.algorithm", RolloutCorrectionConfig=Placeholder)
    stub("verl.workers.config.actor", PolicyLossConfig=Placeholder)

    def load(name: str, path: str) -> types.ModuleType:
        spec = importlib.util.spec_from_file_location(name, os.path.join(verl_root, path))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    functional = load("verl.utils.torch_functional", "verl/utils/torch_functional.py")
    sys.modules["verl.utils"].torch_functional = functional
    return load("verl.trainer.ppo.rollout_corr_helper", "verl/trainer/ppo/rollout_corr_helper.py")


def main() -> None:
    import torch

    sys.path.insert(0, ROOT)
    from tests.golden.make_trl_correction_golden import make_inputs, rows

    if len(sys.argv) != 2:
        sys.exit(__doc__)
    helper = load_verl(sys.argv[1])
    inputs = make_inputs()
    trainer, sampler, mask = inputs["trainer"], inputs["sampler"], inputs["mask"]
    forms = {"finite": torch.where(torch.isnan(sampler), trainer, sampler), "nan": sampler}
    golden: dict[str, Any] = {
        "how": "tests/golden/make_verl_correction_golden.py",
        "versions": {"verl": COMMIT, "files_sha256": FILES, "torch": torch.__version__,
                     "python": sys.version.split()[0]},
        "inputs": {"trainer": rows(trainer), "mask": mask.tolist(),
                   **{f"sampler_{form}": rows(values) for form, values in forms.items()}},
        "truncated_is": [],
        "rejection": [],
    }
    for form, form_sampler in forms.items():
        log_ratio = trainer - form_sampler  # as compute_rollout_correction_and_rejection_mask's step 1
        for level, threshold in IS_CASES:
            weights, _ = helper.compute_rollout_correction_weights(
                log_ratio=log_ratio, response_mask=mask, rollout_is=level, rollout_is_threshold=threshold
            )
            golden["truncated_is"].append({"form": form, "rollout_is": level, "threshold": threshold,
                                           "weights": rows(weights)})
        for option, threshold in RS_CASES:
            kept, _ = helper.compute_rollout_rejection_mask(
                log_ratio=log_ratio, response_mask=mask, rollout_rs=option, rollout_rs_threshold=threshold
            )
            golden["rejection"].append({"form": form, "rollout_rs": option, "threshold": threshold,
                                        "mask": kept.tolist()})
    with open(OUT, "w", encoding="utf-8") as file:
        json.dump(golden, file, separators=(",", ":"))
        file.write("\n")
    print(f"wrote {OUT}: {len(golden['truncated_is'])} IS cases, {len(golden['rejection'])} rejection cases")


if __name__ == "__main__":
    main()
