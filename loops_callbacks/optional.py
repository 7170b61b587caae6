"""The optional 'hf' extra (``transformers``, ``datasets``, ``pyarrow``), and vLLM: imported when a feature needs it.

``import_optional(module, feature)`` imports a module of the extra, or raises an ``ImportError``
that names the feature, the package and how to install the extra (``HF_EXTRA_HINT``: the
editable install of the checkout this runs from, else the extra's packages). The data readers,
the tokenizer, ``HFDPOModule`` and the demos use it, so the base install works without the extra;
``integrations.vllm.import_vllm`` too, with ``needs`` saying how to install vLLM.

Examples:
    >>> import_optional("json", "reading JSON").__name__
    'json'
"""

from __future__ import annotations

import importlib
import shlex
from pathlib import Path
from typing import Any

__all__: list[str] = []  # the package's optional imports: nothing here is for users to import

HF_EXTRA_PACKAGES = ("transformers>=4.56", "datasets>=3.0", "pyarrow>=15")
"""The 'hf' extra of pyproject.toml, for a package installed from a wheel (no checkout to install from)."""


def _hf_extra_hint(checkout: Path = Path(__file__).resolve().parents[1]) -> str:
    """How to install the 'hf' extra: ``pip install -e ".[hf]"`` in the checkout this runs from, else its packages.

    Examples:
        >>> _hf_extra_hint(Path("/nowhere"))
        'pip install "transformers>=4.56" "datasets>=3.0" "pyarrow>=15"'
    """
    if (checkout / "pyproject.toml").is_file():
        return f'cd {shlex.quote(str(checkout))} && pip install -e ".[hf]"'
    return "pip install " + " ".join(f'"{requirement}"' for requirement in HF_EXTRA_PACKAGES)


HF_EXTRA_HINT = _hf_extra_hint()


def import_optional(module: str, feature: str, needs: str | None = None) -> Any:
    """Import ``module`` (``transformers``, ``datasets``, ``pyarrow``), or an ImportError saying that ``feature``
    needs it: ``needs`` (what to install and how), by default the package and the 'hf' extra.

    Examples:
        >>> import_optional("json", "reading JSON").__name__
        'json'
        >>> import_optional("no_such_module", "the demo", "vLLM, which is not installed: pip install vllm")
        Traceback (most recent call last):
        ...
        ImportError: the demo needs vLLM, which is not installed: pip install vllm
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        needs = needs or f"the {module.split('.')[0]!r} package, part of the 'hf' extra: {HF_EXTRA_HINT}"
        raise ImportError(f"{feature} needs {needs}") from error
