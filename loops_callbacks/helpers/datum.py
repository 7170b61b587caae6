"""The Loops SDK's import path for ``attach_reference_logprobs`` (``loops.helpers.datum``).

Only the package name changes: ``from loops_callbacks.helpers.datum import attach_reference_logprobs``.
The implementation lives in ``loops_callbacks.reference.attach``.

Examples:
    >>> from loops_callbacks.helpers.datum import attach_reference_logprobs
    >>> attach_reference_logprobs.__module__
    'loops_callbacks.reference.attach'
"""

from loops_callbacks.reference.attach import attach_reference_logprobs

__all__ = ["attach_reference_logprobs"]
