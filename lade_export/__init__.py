"""lade-export: export a LLaMA-family decoder step to ONNX with lookahead-shaped inputs,
compile it per lookahead profile, and run exact lookahead decoding around the engine.

Modules: :mod:`.graph` (step module, export, parity), :mod:`.ngram` (pool, window, step
layout), :mod:`.runtime` (decoding loop), :mod:`.backends` (ONNX Runtime, PyTorch,
TensorRT engines), :mod:`.profile` (W, N, G), :mod:`.artifact` (build directories,
manifest), :mod:`.build` (the build pipeline), :mod:`.cli`.
"""

__version__ = "0.1.0"
