"""``python -m lade_export.cli …``: the ``lade-export`` command line."""

from . import run

run()
