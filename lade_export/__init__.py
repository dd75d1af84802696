"""lade-export: export a LLaMA-family decoder step to ONNX with lookahead-shaped inputs,
compile it per lookahead profile, and run exact lookahead decoding around the engine.

Runtime (no PyTorch, no transformers): :func:`load` an artifact, then
``model.generate(...)`` or ``model.stream(...)`` (:mod:`.api`). The loop is
:mod:`.runtime`, the algorithm :mod:`.lookahead` on :mod:`.ngram`, text in and out
:mod:`.tokenizer` and :mod:`.detokenize`, engines :mod:`.backends`, profiles
:mod:`.profile`, the artifact contract :mod:`.artifact` and :mod:`.specs`.

Export time (the ``export`` extra): :mod:`.model_source`, :mod:`.graph` (step module,
export, parity), :mod:`.build`, :mod:`.check`; benchmarks :mod:`.compare`, :mod:`.tune`;
the command line :mod:`.cli`.

Serving: :mod:`.serving` writes a Triton Inference Server model repository
(``lade-export triton``) whose Python-backend model streams each request's decode steps.
"""

__version__ = "0.2.0"

__all__ = ["load", "Model", "Stream", "__version__"]


def __getattr__(name):  # keep ``import lade_export`` cheap: the API loads on first use
    if name in ("load", "Model", "Stream"):
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'lade_export' has no attribute {name!r}")
