"""``python -m specenv.cli``: the ``specenv`` command line."""

from specenv.cli import main

main()
