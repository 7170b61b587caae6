"""LightningModules: DPO on any Hugging Face causal LM, and the DPO loss they share.

- ``dpo``: ``dpo_loss``, ``DPOModule`` (the steps, metrics and optimizer of any DPO policy) and
  ``HFDPOModule`` (a Hugging Face causal LM from a checkpoint or a config dict).

``transformers`` is imported when an ``HFDPOModule`` is made (the ``hf`` extra).

Examples:
    >>> from loops_callbacks.models import HFDPOModule
    >>> HFDPOModule.__name__
    'HFDPOModule'
"""

from loops_callbacks.models.dpo import DPOModule, HFDPOModule, dpo_loss

__all__ = ["DPOModule", "HFDPOModule", "dpo_loss"]
