"""The ``lade-export`` command line: it parses flags and prints; the work is done by the
modules each command calls (the build by :mod:`lade_export.export.build`, decoding by
:mod:`lade_export.api`, benchmarks by :mod:`lade_export.evaluation`, serving by
:mod:`lade_export.serving`).

Every user error ends in one line on stderr (``error: …``) and a non-zero exit status:
2 for bad input, 1 for a failed check (parity, exactness), 130 when interrupted; 141, without a
message, when ``generate``'s reader closes stdout (as SIGPIPE would).

=============  ==============================================================
module         commands
=============  ==============================================================
``build``      ``build``, ``export``, ``check`` (need the ``export`` extra)
``decode``     ``generate``, ``inspect``
``evaluate``   ``compare``, ``tune``
``serve``      ``serve`` (OpenAI HTTP API), ``triton`` (a Triton model repository)
=============  ==============================================================

``common`` holds the group (``main``), the error printing and the options several commands
share. Each command imports what it runs when it runs, so importing the CLI imports neither
torch nor the export stack.
"""

from .common import main
from . import build, decode, evaluate, serve  # noqa: F401 (each adds its commands to main)

__all__ = ["main"]
