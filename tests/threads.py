"""Running a test's concurrent requests, each from a thread of its own."""

from __future__ import annotations

import threading
from typing import Callable


def run_in_threads(run: Callable[[int], None], count: int) -> None:
    """Call ``run(i)`` for every ``i`` in ``range(count)``, each in a thread of its own, all
    started before any is joined; returns once every one has ended (an exception in a
    thread ends that thread only: ``run`` records what the test checks)."""
    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
