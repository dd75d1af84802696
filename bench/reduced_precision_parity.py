"""How far a reduced-precision step graph lands from the float32 PyTorch step (the
figures behind :data:`lade_export.export.tensorrt_build.PRECISION_BOUNDS`).

Exports the model's step in float16 the way a TensorRT 11 build does
(:func:`lade_export.export.precision.export_reduced_precision`, then the sanitizer), runs
it under ONNX Runtime on the build's parity prompt and cases (prefill, a lookahead step,
a greedy step; :func:`lade_export.export.parity.check_parity`) and prints, per case, max
|Δlogit| and max |Δlogit| / max |logit| (the relative figure the fp16 bound limits) and
whether the argmax agrees at every row. Results: bench/results/tensorrt-precision.md.

    python bench/reduced_precision_parity.py ../shared/models/stories260K
    python bench/reduced_precision_parity.py smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from lade_export.export.build import parity_prompt_ids
from lade_export.export.model_source import load_model
from lade_export.export.parity import check_parity
from lade_export.export.precision import export_reduced_precision
from lade_export.export.sanitize import sanitize_onnx
from lade_export.graph import DecoderStep
from lade_export.profile import resolve_profile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a model lade-export build takes (directory, GGUF, shipped name)")
    parser.add_argument("--dtype", default="float16", choices=["float16"],
                        help="graph dtype (bfloat16 has no ONNX Runtime CPU kernels)")
    parser.add_argument("--profile", default="default", help="lookahead profile of the lookahead case")
    args = parser.parse_args()
    loaded = load_model(args.model)
    step = DecoderStep(loaded.model).eval()
    chat = bool(getattr(loaded.tokenizer, "chat_template", None))
    prompt = parity_prompt_ids(loaded.tokenizer, chat)[: max(2, step.dims.max_context // 2)]
    with tempfile.TemporaryDirectory(prefix="lade-precision-") as tmp:
        raw = export_reduced_precision(step, args.dtype, Path(tmp) / "raw.onnx")
        sanitize_onnx(raw, Path(tmp) / "model.onnx")
        cases = check_parity(step, Path(tmp) / "model.onnx", prompt, resolve_profile(args.profile))
    for c in cases:
        print(f"{c.label:<24} step {c.step:>3} past {c.past:>3}  max|Δ| {c.max_abs:.3g}  rel {c.rel:.3g}  "
              f"argmax equal {c.argmax_equal}")
    print(f"worst rel {max(c.rel for c in cases):.3g} over {len(cases)} cases, prompt {len(prompt)} tokens")


if __name__ == "__main__":
    main()
