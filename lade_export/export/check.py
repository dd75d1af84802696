"""``lade-export check DIR``: validate an artifact directory.

1. Every file's sha256 against the manifest.
2. Polygraphy's comparator runs the ONNX graph under ONNX Runtime, the PyTorch reference
   step (the checkpoint named in the manifest) and, where a TensorRT runtime and a GPU
   exist, each TensorRT engine, on lookahead-shaped feeds generated from each recorded
   lookahead profile: real token ids (the build's parity prompt), a real non-empty KV
   cache, the custom mask and non-contiguous position ids, plus prefill and greedy
   shapes. Each engine runs through :class:`lade_export.backends.tensorrt.TensorRTEngine`
   restricted to it, so every feed runs in the optimization profile that covers it
   (prefill feeds in the prefill optimization profile, steps with a cache in the decode
   one); feeds no optimization profile of an engine covers (a larger lookahead profile's
   step) are left out for that engine and listed in the report's notes. The engine is
   wrapped as a Polygraphy runner rather than using ``TrtRunner``, which keeps one
   optimization profile per activation and needs ``libcudart`` on the loader path: the
   wrapper runs each feed in the optimization profile that covers it, through the same
   code that serves requests.
3. Per output: max abs error and max abs error / max |reference|; ``next_token_ids``
   must match exactly. Anything past the tolerance fails the check, naming the output
   and the case where it failed.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import numpy as np

from ..artifact import Artifact, checksum_errors  # noqa: F401  (checksum_errors: part of this module's API)
from .parity import PARITY_MAX_ABS, PARITY_MAX_REL


@dataclasses.dataclass
class OutputError:
    """Difference of one output between a runner and the PyTorch reference, worst over all feeds."""

    runner: str
    output: str
    max_abs: float
    rel: float
    case: str
    ok: bool
    judged: bool = True  # False: reported only (a quantized graph against the float32 step)


@dataclasses.dataclass
class CheckReport:
    """Result of :func:`check_artifact`: checksum problems, per-output errors, overall verdict."""

    checksum_errors: list
    output_errors: list
    cases: list
    notes: list = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.checksum_errors and all(e.ok for e in self.output_errors if e.judged)

    def failures(self) -> list[str]:
        msgs = list(self.checksum_errors)
        for e in self.output_errors:
            if e.judged and not e.ok:
                msgs.append(f"{e.runner}: output {e.output} differs from PyTorch at {e.case}: max |Δ| {e.max_abs:.3g}, "
                            f"relative {e.rel:.3g}")
        return msgs


def _input_metadata(input_specs):
    from polygraphy.common import TensorMetadata

    meta = TensorMetadata()
    for spec in input_specs:
        meta.add(spec["name"], np.dtype(spec["dtype"]), [d if isinstance(d, int) else -1 for d in spec["shape"]])
    return meta


def _runner(name: str, run, input_specs, output_names):
    """A Polygraphy runner named ``name`` around ``run(feeds) -> {output: array}``."""
    from polygraphy.backend.base import BaseRunner

    class StepRunner(BaseRunner):
        def __init__(self):
            super().__init__(name=name, prefix="lade-runner")

        def activate_impl(self):
            pass

        def get_input_metadata_impl(self):
            return _input_metadata(input_specs)

        def infer_impl(self, feed_dict):
            import time

            t = time.perf_counter()
            out = run(dict(feed_dict))
            self.inference_time = time.perf_counter() - t
            return OrderedDict((n, out[n]) for n in output_names)

        def deactivate_impl(self):
            pass

    return StepRunner()


def _torch_runner(step_module, input_specs, output_names):
    """Polygraphy runner for the PyTorch reference step on the CPU."""
    from ..graph import run_torch_step

    return _runner("pytorch", lambda feeds: run_torch_step(step_module, feeds), input_specs, output_names)


def compare_runner(runner: str, output_names, labels, reference, results, max_abs: float, max_rel: float) -> list:
    """One :class:`OutputError` per output: the worst difference of ``results`` from
    ``reference`` (per-case output dicts, in ``labels`` order) — the worst *failing* case
    when any case fails, so the reported case is one that failed.

    An output passes a case when max |Δ| ≤ ``max_abs`` and max |Δ| / max |reference| ≤
    ``max_rel``; ``next_token_ids`` must be equal.
    """
    errors = []
    for out in output_names:
        worst_ok, worst_bad = None, None
        for label, ref_it, got_it in zip(labels, reference, results):
            ref, got = np.asarray(ref_it[out]), np.asarray(got_it[out])
            if out == "next_token_ids":
                same = ref.shape == got.shape and np.array_equal(ref, got)
                diff, rel = (0.0, 0.0) if same else (float(np.max(np.abs(ref - got))) if ref.shape == got.shape
                                                     else float("inf"), 1.0)
                ok = same
            elif ref.size == 0:
                continue
            else:
                diff = float(np.max(np.abs(ref.astype(np.float64) - got.astype(np.float64))))
                rel = diff / max(float(np.max(np.abs(ref))), 1e-30)
                ok = diff <= max_abs and rel <= max_rel
            case = OutputError(runner, out, diff, rel, label, ok)
            if ok and (worst_ok is None or diff > worst_ok.max_abs):
                worst_ok = case
            if not ok and (worst_bad is None or diff > worst_bad.max_abs):
                worst_bad = case
        errors.append(worst_bad or worst_ok or OutputError(runner, out, 0.0, 0.0, labels[0] if labels else "", True))
    return errors


def check_artifact(root, max_abs: float = PARITY_MAX_ABS, max_rel: float = PARITY_MAX_REL, status=None) -> CheckReport:
    """Validate ``root`` (see module doc) and return a :class:`CheckReport`.

    Raises:
        ArtifactError: the directory or manifest is missing or of another schema version, or a
            listed file is missing or of another size (checksum mismatches are reported instead).
        ModelSourceError: the PyTorch reference (manifest ``source.model``) cannot be loaded.
    """
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy.comparator import Comparator

    from ..backends.tensorrt_install import tensorrt_unavailable_reason
    from .build_checks import parity_prompt_ids
    from ..graph import DecoderStep
    from .parity import reference_cases
    from .model_source import load_model

    from polygraphy.logger import G_LOGGER

    G_LOGGER.module_severity = G_LOGGER.ERROR
    say = status or (lambda m: None)
    artifact = Artifact(root, verify=False)
    say("verifying checksums")
    artifact.verify_files(hashes=False)  # a missing or resized file cannot run at all: one line, no report
    sums = checksum_errors(artifact)
    say(f"loading the PyTorch reference {artifact.spec.source.model}")
    loaded = load_model(artifact.spec.source.model)
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
    output_names = [o.name for o in artifact.spec.graph.outputs]
    input_specs = [t.as_dict() for t in artifact.spec.graph.inputs]
    if artifact.kv_layout == "sequence-major" and artifact.custom_ops_path is None:
        from ..backends.onnxruntime import cannot_load, check_graph_dims

        try:  # loaded here, so that a graph ONNX Runtime rejects is the one line generate gives too
            session = SessionFromOnnx(str(artifact.onnx_path))()
        except Exception as err:  # ORT raises its own InvalidProtobuf/Fail types
            raise cannot_load(artifact.onnx_path, err) from None
        check_graph_dims(session.get_inputs(), artifact.kv_layout, artifact.dims, artifact.root / "manifest.json")
        ort_runner = OnnxrtRunner(session, name="onnxruntime")
    else:  # a shared cache buffer per tensor (fed through the layout converter), or custom ops
        from ..backends.onnxruntime import OrtEngine
        from ..feeds import run_sequence_major
        from ..specs import step_io_specs

        d = artifact.dims
        input_specs = [t.as_dict() for t in step_io_specs(d.num_layers, d.kv_heads, d.head_dim, d.vocab)[0]]
        ort_engine = OrtEngine(artifact.onnx_path, d, custom_ops=artifact.custom_ops_path)
        ort_runner = _runner("onnxruntime", lambda f: run_sequence_major(ort_engine, f, with_logits=True),
                             input_specs, output_names)
    runners = [_torch_runner(step, input_specs, output_names), ort_runner]
    say(f"comparing {', '.join(r.name for r in runners)} on {len(feeds)} feeds")
    results = Comparator.run(runners, data_loader=feeds)
    by_runner = {name: iters for name, iters in results}
    reference = by_runner["pytorch"]
    errors = compare_runner("onnxruntime", output_names, labels, reference, by_runner["onnxruntime"], max_abs, max_rel)
    notes = []
    precision = artifact.spec.graph.precision
    if precision in ("int4", "int8"):  # no quantized PyTorch reference: the differences are reported, not judged
        errors = [dataclasses.replace(e, judged=False) for e in errors]
        quality = artifact.spec.quantization.quality if artifact.spec.quantization is not None else None
        measured = (f" (build-time quality against the float32 graph: top-1 agreement "
                    f"{100 * quality.top1_agreement:.1f}%, max |Δlogit| {quality.max_abs_logit_diff:.3g})"
                    if quality is not None and quality.top1_agreement is not None else "")
        notes.append(f"{precision} graph: its differences from the float32 PyTorch step are its quantization's"
                     f"{measured}; they are shown, not held to the float32 bounds")
    engines = artifact.spec.engines
    reason = tensorrt_unavailable_reason() if engines else None
    if reason:
        notes.append(f"TensorRT engines not checked: {reason}")
    elif engines:
        errors += _check_engines(artifact, engines, feeds, labels, reference, input_specs, output_names, notes, say)
    return CheckReport(sums, errors, labels, notes)


def _check_engines(artifact, engines, feeds, labels, reference, input_specs, output_names, notes, say) -> list:
    """Compare every TensorRT engine with the PyTorch reference on the feeds its
    optimization profiles cover (each in the optimization profile that covers it)."""
    from polygraphy.comparator import Comparator

    from ..backends.tensorrt import TensorRTEngine
    from .tensorrt_build import PRECISION_BOUNDS

    errors = []
    for entry in engines:
        name = entry.lookahead_profile.name
        engine = TensorRTEngine(artifact, engine=name)
        try:
            chosen = [engine.optimization_profile_for(f) for f in feeds]
            keep = [i for i, c in enumerate(chosen) if c is not None]
            skipped = [labels[i] for i, c in enumerate(chosen) if c is None]
            if skipped:
                notes.append(f"tensorrt:{name}: no optimization profile covers {', '.join(skipped)}; not run there")
            runner = _runner(f"tensorrt:{name}", lambda f: engine.run(f, with_logits=True), input_specs, output_names)
            say(f"comparing {runner.name} on {len(keep)} feeds ({engine.runtime_description})")
            got = dict(Comparator.run([runner], data_loader=[feeds[i] for i in keep]))[runner.name]
            max_abs, max_rel = PRECISION_BOUNDS.get(entry.precision, PRECISION_BOUNDS["fp32"])
            case_labels = [f"{labels[i]} ({chosen[i].split(':', 1)[1]})" for i in keep]
            errors += compare_runner(runner.name, output_names, case_labels, [reference[i] for i in keep], got,
                                     max_abs, max_rel)
        finally:
            engine.close()
    return errors
