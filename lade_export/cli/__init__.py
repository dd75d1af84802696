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
share; :func:`run` is the program (the ``lade-export`` script, ``python -m lade_export.cli``).
Each command imports what it runs when it runs, so importing the CLI imports neither torch
nor the export stack.
"""

import signal
import threading

from .common import main
from . import build, decode, evaluate, serve  # noqa: F401 (each adds its commands to main)

__all__ = ["main", "run"]


def run() -> None:
    """The ``lade-export`` program (its script, ``python -m lade_export.cli``, ``cli.py``):
    :data:`main`, then SIGINT ignored for the interpreter's teardown. Once a command has
    returned or exited, its work is done (a build's artifact is complete, its ``built …``
    line printed); a Ctrl-C in the half second torch and the other libraries take to shut
    down ended the process by SIGINT (no message) or printed a traceback from an exit
    handler. For whole processes only: it leaves SIGINT ignored. In-process callers (tests)
    invoke :data:`main`.

    Returns:
        None once the command succeeded; otherwise ``SystemExit`` with its status (1, 2,
        130; see the module docstring).
    """
    try:
        main()
    finally:
        if threading.current_thread() is threading.main_thread():  # signal() works there only
            signal.signal(signal.SIGINT, signal.SIG_IGN)
