"""Which weight matrices' int8 activations cost the integer path its top-1 agreement
(issue 20: ≥ 98% asked against the float32 engine).

Takes an integer-path artifact (``--kernels lade``, ``--compute int8``) and the
float32-compute artifact of the same weights (``--compute float32``: the float32 graph's
tokens, 100% agreement in its manifest). The float32-compute engine answers the first
--prompts MT-Bench questions greedily (--answer-tokens each); both engines are then
teacher-forced on those answers and their argmaxes compared at every answer position, as
the build's quality report does (:func:`lade_export.export.quantize.teacher_forced_logits`),
over more positions.

Each variant turns the int8 activations off (float32 compute, the ``MatMulBlockQ``
attribute ``compute`` removed) for the matrices whose node names contain one of its
comma-separated parts (``q_proj`` = the fused Q/K/V projection, ``o_proj``, ``gate_proj`` =
the fused gate/up projection, ``down_proj``, ``lm_head``); ``none`` keeps every matrix on the
integer path. A variant's graph is a copy of the artifact's in a temporary folder. Printed
per variant: the agreement, and the float32 engine's top-2 logit gap at each position that
flipped (how close to a tie it was).

Usage:
    python bench/activation_sensitivity.py /work/artifacts/smollm2-lade-int8-k5 \\
        /work/artifacts/smollm2-lade-f32 --prompts 16 --variants none lm_head q_proj down_proj
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("integer_artifact", type=Path)
    ap.add_argument("float32_artifact", type=Path)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--answer-tokens", type=int, default=64)
    ap.add_argument("--variants", nargs="+", default=["none", "lm_head", "q_proj", "o_proj", "gate_proj", "down_proj"])
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)

    import onnx

    from lade_export.artifact import Artifact
    from lade_export.backends.onnxruntime import OrtEngine
    from lade_export.evaluation.datasets import load_prompts
    from lade_export.export.quantize import teacher_forced_logits
    from lade_export.profile import GREEDY
    from lade_export.runtime import Decoder

    reference_art, integer_art = Artifact(args.float32_artifact), Artifact(args.integer_artifact)
    dims, tokenizer = reference_art.dims, reference_art.tokenizer()
    reference = OrtEngine(reference_art.onnx_path, dims, threads=args.threads, custom_ops=reference_art.custom_ops_path)
    sequences = []
    for prompt in load_prompts("mt_bench", limit=args.prompts, chat=True):
        ids = tokenizer.encode_prompt(prompt.text, chat=True)
        answer = Decoder(reference, [], dims.max_context).generate(ids, args.answer_tokens, GREEDY)
        sequences.append((list(ids) + answer.token_ids, len(ids)))
    expected = list(teacher_forced_logits(reference, sequences))  # compared with every variant
    reference.close()
    top2 = [np.sort(x, axis=-1)[:, -2:] for x in expected]
    gaps = np.concatenate([t[:, 1] - t[:, 0] for t in top2])
    print(f"{len(gaps)} answer positions of {len(sequences)} MT-Bench answers; float32 top-2 gaps < 0.1 at "
          f"{int((gaps < 0.1).sum())}, < 1 at {int((gaps < 1).sum())}")
    print("| int8 activations off for | matrices | top-1 agreement | top-2 gaps where the argmax flipped |")
    print("| --- | ---: | ---: | --- |")
    model = onnx.load(str(integer_art.onnx_path), load_external_data=False)
    with tempfile.TemporaryDirectory(prefix="activation-sensitivity.") as tmp:
        folder = Path(tmp)
        shutil.copy(integer_art.onnx_path.parent / "model.onnx.data", folder / "model.onnx.data")
        for variant in args.variants:
            parts = [] if variant == "none" else variant.split(",")
            graph = onnx.ModelProto()
            graph.CopyFrom(model)
            changed = 0
            for node in graph.graph.node:
                if node.op_type == "MatMulBlockQ" and any(p in node.name for p in parts):
                    for attr in [a for a in node.attribute if a.name == "compute"]:
                        node.attribute.remove(attr)
                        changed += 1
            onnx.save_model(graph, str(folder / "model.onnx"))
            engine = OrtEngine(folder / "model.onnx", dims, threads=args.threads,
                               custom_ops=integer_art.custom_ops_path)
            got = list(teacher_forced_logits(engine, sequences))  # before the engine closes
            engine.close()
            agree, flipped = 0, []
            for want, have, t in zip(expected, got, top2):
                same = want.argmax(-1) == have.argmax(-1)
                agree += int(same.sum())
                flipped += list((t[:, 1] - t[:, 0])[~same])
            shown = ", ".join(f"{g:.3f}" for g in sorted(flipped)[:8]) + (" …" if len(flipped) > 8 else "")
            print(f"| {variant} | {changed} | {agree}/{len(gaps)} = {100 * agree / len(gaps):.2f}% | {shown} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
