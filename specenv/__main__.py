"""``python -m specenv``: the ``specenv`` command line (as ``python -m specenv.cli``)."""

from specenv.cli import main

main()
