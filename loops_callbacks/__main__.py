"""``python -m loops_callbacks``: the same as the ``loops-callbacks`` command."""

from loops_callbacks.cli import main

main()
