"""The ``loops-callbacks`` command, also ``python -m loops_callbacks``: ``cache ...`` runs the cache tool
(``loops_callbacks.reference.cache_tool``, without importing Lightning: about 2 s instead of 7), anything else
LightningCLI (``loops_callbacks.cli.main``).

Examples:
    loops-callbacks cache list runs/dpo_tiny/reference_logprobs
    loops-callbacks fit --config configs/rl_tiny.yaml
"""

import sys
from collections.abc import Sequence


def main(args: Sequence[str] | None = None) -> None:
    """Run the command on ``args`` (default: ``sys.argv[1:]``); exits with its status."""
    argv = list(sys.argv[1:] if args is None else args)
    if argv[:1] == ["cache"]:
        from loops_callbacks.reference.cache_tool import main as cache_tool

        raise SystemExit(cache_tool(argv[1:]))
    from loops_callbacks.cli import main as lightning_cli

    lightning_cli(args)  # None: LightningCLI reads sys.argv itself (it warns when given both)


if __name__ == "__main__":
    main()
