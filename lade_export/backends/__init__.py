"""Engine backends. Each module imports its framework lazily, so a missing optional
backend (TensorRT) costs nothing until it is asked for.

Every engine has the same small interface (see :class:`lade_export.runtime.Engine`):
``dims`` (model shape facts), ``run(feeds, with_logits=False) -> outputs`` on numpy
arrays named as in :mod:`lade_export.specs`, and ``close()``.
"""

BACKENDS = ("ort", "torch", "tensorrt")
