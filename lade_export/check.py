"""``lade-export check DIR``: validate an artifact directory.

1. Every file's sha256 against the manifest.
2. Polygraphy's comparator runs the ONNX graph under ONNX Runtime, the PyTorch reference
   step (the checkpoint named in the manifest) and, where TensorRT and a GPU exist,
   each TensorRT engine, on lookahead-shaped feeds generated from each recorded profile:
   real token ids (the build's parity prompt), a real non-empty KV cache, the custom
   mask and non-contiguous position ids, plus prefill and greedy shapes.
3. Per output: max abs error and max abs error / max |reference|; ``next_token_ids``
   must match exactly. Anything past the tolerance fails the check, naming the output.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import numpy as np

from .artifact import Artifact, sha256_file
from .graph import PARITY_MAX_ABS, PARITY_MAX_REL

# TensorRT engines run in reduced precision; their bound is looser but the argmax must still agree.
TRT_MAX_ABS = {"fp32": 1e-3, "fp16": 5e-2, "bf16": 2e-1}


@dataclasses.dataclass
class OutputError:
    """Difference of one output between a runner and the PyTorch reference, worst over all feeds."""

    runner: str
    output: str
    max_abs: float
    rel: float
    case: str
    ok: bool


@dataclasses.dataclass
class CheckReport:
    """Result of :func:`check_artifact`: checksum problems, per-output errors, overall verdict."""

    checksum_errors: list
    output_errors: list
    cases: list

    @property
    def ok(self) -> bool:
        return not self.checksum_errors and all(e.ok for e in self.output_errors)

    def failures(self) -> list[str]:
        msgs = list(self.checksum_errors)
        for e in self.output_errors:
            if not e.ok:
                msgs.append(f"{e.runner}: output {e.output} differs from PyTorch at {e.case}: max |Δ| {e.max_abs:.3g}, "
                            f"relative {e.rel:.3g}")
        return msgs


def checksum_errors(artifact: Artifact) -> list[str]:
    """One message per file that is missing or whose sha256 differs from the manifest."""
    errors = []
    for name, entry in artifact.manifest.get("files", {}).items():
        path = artifact.root / name
        if not path.is_file():
            errors.append(f"{name}: missing")
        elif sha256_file(path) != entry["sha256"]:
            errors.append(f"{name}: sha256 does not match the manifest")
    return errors


def _torch_runner(step_module, input_specs, output_names):
    from polygraphy.backend.base import BaseRunner

    from .graph import run_torch_step

    class TorchStepRunner(BaseRunner):
        """Polygraphy runner for the PyTorch reference step on the CPU."""

        def __init__(self):
            super().__init__(name="pytorch", prefix="pytorch-runner")

        def activate_impl(self):
            pass

        def get_input_metadata_impl(self):
            from polygraphy.common import TensorMetadata

            meta = TensorMetadata()
            for spec in input_specs:
                shape = [d if isinstance(d, int) else -1 for d in spec["shape"]]
                meta.add(spec["name"], np.dtype(spec["dtype"]), shape)
            return meta

        def infer_impl(self, feed_dict):
            import time

            t = time.perf_counter()
            out = run_torch_step(step_module, feed_dict)
            self.inference_time = time.perf_counter() - t
            return OrderedDict((n, out[n]) for n in output_names)

        def deactivate_impl(self):
            pass

    return TorchStepRunner()


def check_artifact(root, max_abs: float = PARITY_MAX_ABS, max_rel: float = PARITY_MAX_REL, status=None) -> CheckReport:
    """Validate ``root`` (see module doc) and return a :class:`CheckReport`.

    Raises:
        ArtifactError: the directory or manifest is missing or of another schema version.
        ModelSourceError: the PyTorch reference (manifest ``source.model``) cannot be loaded.
    """
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy.comparator import Comparator

    from .backends.tensorrt import tensorrt_unavailable_reason
    from .build import parity_prompt_ids
    from .graph import DecoderStep, reference_cases
    from .model_source import load_model

    from polygraphy.logger import G_LOGGER

    G_LOGGER.module_severity = G_LOGGER.ERROR
    say = status or (lambda m: None)
    artifact = Artifact(root, verify=False)
    say("verifying checksums")
    sums = checksum_errors(artifact)
    say(f"loading the PyTorch reference {artifact.manifest['source']['model']}")
    loaded = load_model(artifact.manifest["source"]["model"])
    step = DecoderStep(loaded.model).eval()
    prompt = parity_prompt_ids(loaded.tokenizer, artifact.has_chat_template)
    feeds, labels = [], []
    profiles = artifact.profiles() or [None]
    for i, profile in enumerate(profiles):
        for label, f in reference_cases(step, prompt, profile):
            if i > 0 and not label.startswith("lookahead"):
                continue  # prefill and greedy shapes once
            labels.append(label)
            feeds.append(OrderedDict(f))
    output_names = [o["name"] for o in artifact.manifest["graph"]["outputs"]]
    runners = [_torch_runner(step, artifact.manifest["graph"]["inputs"], output_names), OnnxrtRunner(SessionFromOnnx(str(artifact.onnx_path)),
                                                                            name="onnxruntime")]
    bounds = {"onnxruntime": max_abs}
    if artifact.manifest.get("engines") and tensorrt_unavailable_reason() is None:
        from polygraphy.backend.trt import EngineFromBytes, TrtRunner

        for e in artifact.manifest["engines"]:
            name = f"tensorrt:{e['profile']['name']}"
            runners.append(TrtRunner(EngineFromBytes((artifact.root / e["file"]).read_bytes()), name=name))
            bounds[name] = TRT_MAX_ABS.get(e["precision"], max_abs)
    say(f"comparing {', '.join(r.name for r in runners)} on {len(feeds)} feeds")
    results = Comparator.run(runners, data_loader=feeds)
    by_runner = {name: iters for name, iters in results}
    reference = by_runner["pytorch"]
    errors = []
    for runner_name, iters in by_runner.items():
        if runner_name == "pytorch":
            continue
        bound = bounds[runner_name]
        for out in output_names:
            worst = OutputError(runner_name, out, 0.0, 0.0, labels[0], True)
            for label, ref_it, got_it in zip(labels, reference, iters):
                ref, got = np.asarray(ref_it[out]), np.asarray(got_it[out])
                if out == "next_token_ids":
                    if not np.array_equal(ref, got):
                        worst = OutputError(runner_name, out, float(np.max(np.abs(ref - got))), 1.0, label, False)
                    continue
                if ref.size == 0:
                    continue
                diff = float(np.max(np.abs(ref.astype(np.float64) - got.astype(np.float64))))
                rel = diff / max(float(np.max(np.abs(ref))), 1e-30)
                ok = diff <= bound and (rel <= max_rel or bound != max_abs)
                if diff > worst.max_abs or not ok:
                    worst = OutputError(runner_name, out, diff, rel, label, ok and worst.ok)
            errors.append(worst)
    return CheckReport(sums, errors, labels)
