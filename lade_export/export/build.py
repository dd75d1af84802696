"""The build pipeline: options checked → load → rope plan → export → parity (ONNX Runtime vs
the PyTorch step; the graph vs transformers' model on both sides of every rope threshold) →
TensorRT engines or quantization → tokenizer → manifest, atomically (:func:`build_artifact`;
:func:`dry_run` for ``build --dry-run``).

The options and their checks are :mod:`lade_export.export.build_options`; the checks on real
inputs (tokenizer, transformers parity) and their prompts :mod:`lade_export.export.build_checks`.
"""

from __future__ import annotations

import dataclasses
import datetime
import platform
import time
from pathlib import Path

from .. import __version__
from ..artifact import atomic_directory, check_out, file_entries, write_json_atomic
from ..backends.onnxruntime import OrtEngine
from ..errors import BuildOptionError
from ..graph import DecoderStep, export_onnx
from .build_checks import (parity_prompt_ids, quality_prompts, raise_on_parity, reduced_precision_parity, save_tokenizer,
                           transformers_parity)
from .build_options import BuildOptions
from .parity import PARITY_MAX_ABS, PARITY_MAX_REL, check_parity
from ..kernels import LIBRARY
from ..manifest import (EngineEntry, FileEntry, GraphInfo, Manifest, ModelInfo, Parity, Quantization, Rope, Source,
                       TokenizerInfo)
from .model_source import load_model
from ..specs import step_io_specs

def _versions() -> dict:
    import onnx
    import onnxruntime
    import torch
    import transformers

    return {
        "lade_export": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
    }


def build_tensorrt_engines(step, onnx_path: Path, root: Path, profiles, prompt_ids, engine_options: dict,
                           timing_cache, say) -> list[dict]:
    """Sanitize the graph, re-check its parity, and build one TensorRT engine per profile
    into ``root/engines``, the way the installed TensorRT sets precision
    (:func:`lade_export.export.tensorrt_build.precision_plan`): TensorRT 10 parses the float32
    graph and gets fp16/bf16 builder flags; TensorRT 11 parses the step exported in the
    target precision (:mod:`lade_export.export.precision`), whose parity against the float32
    PyTorch step is checked first (float16 under ONNX Runtime; bfloat16 has no ONNX
    Runtime CPU kernels, so ``lade-export check`` is its check).

    Returns:
        the manifest's ``engines`` entries (plan, TensorRT version, compute capability,
        ``precision_plan``, ``graph_parity``, ``sanitize`` counts, sha256).

    Raises:
        BackendUnavailableError: TensorRT or a GPU is missing, or an unsupported version.
        CheckFailedError: the sanitized (or reduced-precision) graph fails its parity bounds.
    """
    import tempfile

    from ..artifact import sha256_file
    from ..backends.tensorrt_install import check_version
    from .optimization_profiles import engine_plans
    from .sanitize import sanitize_onnx
    from .tensorrt_build import PRECISION_BOUNDS, build_engine, import_builder, precision_plan, require_builder

    require_builder()
    plans = engine_plans(profiles, step.dims, **engine_options)
    precision = engine_options.get("precision", "fp16")
    plan_of_precision = precision_plan(precision, check_version(import_builder()))
    profile = profiles[0] if profiles else None
    entries = []
    with tempfile.TemporaryDirectory(prefix="lade-sanitized-") as scratch:
        say("sanitizing the graph for TensorRT")
        graph = Path(scratch) / "model.onnx"
        counts = sanitize_onnx(onnx_path, graph)
        raise_on_parity(check_parity(step, graph, prompt_ids, profile), "sanitized graph")
        graph_parity = None
        dtype = plan_of_precision["graph_dtype"]
        if dtype != "float32":
            from .precision import export_reduced_precision

            say(f"exporting the step in {dtype} for a strongly typed network")
            (Path(scratch) / "reduced").mkdir()
            raw = export_reduced_precision(step, dtype, Path(scratch) / "reduced" / "raw.onnx")
            graph = Path(scratch) / "reduced" / "model.onnx"
            counts = sanitize_onnx(raw, graph)
            graph_parity = reduced_precision_parity(step, graph, prompt_ids, profile, precision,
                                                     *PRECISION_BOUNDS[precision])
        (root / "engines").mkdir(exist_ok=True)
        for plan in plans:
            say(f"building TensorRT engine {plan['file']}")
            data, info = build_engine(
                graph, plan["optimization_profiles"], precision=plan["precision"], timing_cache=timing_cache,
                version_compatible=plan["version_compatible"], hardware_compatible=plan["hardware_compatible"],
                on_progress=lambda phase, i, n: say(f"TensorRT {phase} {i}/{n or '?'}"),
            )
            (root / plan["file"]).write_bytes(data)
            entries.append({**plan, **info, "graph_parity": graph_parity, "sanitize": counts,
                            "sha256": sha256_file(root / plan["file"])})
    return entries


def quantize_artifact_graph(root: Path, dims, spec, prompts: list[list[int]], threads=None, say=None,
                            prompts_label: str | None = None) -> dict:
    """Replace ``root/model.onnx`` (float32) by its weight-only quantized form and report
    the quality: top-1 agreement and max |Δlogit| against the float32 graph, teacher-forced
    on the float32 engine's own greedy answers (64 tokens) to ``prompts`` (``prompts_label``:
    what they are, recorded as ``quality.prompts``).

    Returns:
        the manifest's ``quantization`` section: ``spec``, ``graph`` (sizes, op counts),
        ``quality`` (:func:`lade_export.export.quantize.quality_report`, plus ``prompts``) and, with the lade kernels,
        ``kernels``: ``library``, ``compute``, ``paths`` (those it holds, per compute type) and
        ``path_at_build`` (the one the quality was measured on).
    """
    from .quantize import quality_report, quantize_step_graph
    from ..profile import GREEDY
    from ..runtime import Decoder

    say = say or (lambda m: None)
    fp32 = root / "model.onnx"
    staged = root / "quantized" / "model.onnx"
    staged.parent.mkdir()
    library = None
    if spec.kernels == "lade":
        from ..kernels import compile_library

        say("compiling the lade kernels")
        library = compile_library(root / LIBRARY)
    say(f"quantizing the layers' weights to {spec.bits} bits (head and embedding: "
        f"{f'{spec.head_bits} bits' if spec.head_bits else 'float32'}; {spec.kernels} kernels)")
    info = quantize_step_graph(fp32, staged, spec)
    say("measuring the quantized graph against the float32 one")
    reference = OrtEngine(fp32, dims, threads=threads)
    quantized = OrtEngine(staged, dims, threads=threads, custom_ops=library)
    sequences = []
    for ids in prompts:
        answer = Decoder(reference, [], dims.max_context).generate(ids, min(64, dims.max_context - len(ids)), GREEDY)
        sequences.append((list(ids) + answer.token_ids, len(ids)))
    quality = quality_report(reference, quantized, sequences)
    if prompts_label:
        quality["prompts"] = prompts_label
    reference.close()
    quantized.close()
    kernels = None
    if library is not None:  # what the library holds, and the path the quality above was measured on
        from ..kernels import library_paths, running_path

        kernels = {"library": LIBRARY, "compute": spec.compute,
                   "paths": {c: list(p) for c, p in library_paths(library).items()},
                   "path_at_build": running_path(library, spec.compute)}
    for name in ("model.onnx", "model.onnx.data"):
        if (root / name).exists():
            (root / name).unlink()
        (staged.parent / name).replace(root / name)
    staged.parent.rmdir()
    return {"spec": spec.as_dict(), "graph": info, "quality": quality, **({"kernels": kernels} if kernels else {})}


#: ``graph.kv_layout`` of the manifest: the cache layout in words, ``{dtype}`` the cache's
#: (float32, or float16 where the graph keeps a half-precision cache).
KV_LAYOUT_TEXT = {
    "sequence-major": "[batch, seq, kv_heads, head_dim] (sequence-major), {dtype}, RoPE applied to keys; "
                      "present.* = this step only",
    "head-major-shared": "[batch, kv_heads, capacity, head_dim] (head-major), {dtype}, RoPE applied to keys, filled "
                         "up to past = mask columns - step; present.* = the same buffer with this step written at "
                         "[past, past+step): bind each present output to its past input's memory",
}


@dataclasses.dataclass(frozen=True)
class DryRun:
    """What ``build --dry-run`` reports, having written nothing.

    Attributes:
        notes: one-line notes for the user (the rope variant capping the context).
        lines: the plan: the files the build would write, and with TensorRT each engine's
            optimization profiles and precision plan, one text line each.
    """

    notes: tuple[str, ...]
    lines: tuple[str, ...]


def dry_run(source: str, profiles, out: str | Path, options: BuildOptions, headers_at_hand: bool = True,
            force: bool = False) -> DryRun:
    """Load ``source`` and describe what :func:`build_artifact` would write at ``out`` with
    ``profiles`` and ``options``, without exporting or writing anything.

    Args:
        headers_at_hand: whether ONNX Runtime's headers are cached (``--kernels lade``:
            otherwise the build would download them first; :meth:`BuildOptions.prepare_kernels`).
        force: the build's ``force`` (an existing build at ``out`` would be replaced).

    Raises:
        ArtifactError: ``out`` is refused as the build would refuse it (:func:`lade_export.artifact.check_out`).
        BuildOptionError, ProfileError, ModelSourceError: as :func:`build_artifact` before its export.
    """
    from .optimization_profiles import describe_plan, engine_plans

    options.check(profiles)
    check_out(out, force)
    step = DecoderStep(load_model(source).model)
    dims = step.dims
    attention = options.attention_for(dims)  # the build's checks that need the model, its messages
    notes = (step.rope.reason,) if step.rope.reason else ()
    for profile in profiles:
        profile.check_fits(dims.max_context)
    library = (", kernels/liblade_kernels.so (compiled" + ("" if headers_at_hand else "; ONNX Runtime's headers "
               "downloaded first, ~150 MB") + ")") if options.kernels == "lade" else ""
    lines = [f"dry run: would write {out}/model.onnx, tokenizer/, manifest.json{library}", f"attention: {attention}"]
    if options.tensorrt:
        from ..backends.tensorrt_install import SUPPORTED_MAJORS, installed_tensorrt_major
        from .tensorrt_build import describe_precision_plan, precision_plan

        major = installed_tensorrt_major()
        majors = (major,) if major in SUPPORTED_MAJORS else SUPPORTED_MAJORS
        installed = f"installed TensorRT {major}" if major in SUPPORTED_MAJORS else \
            f"TensorRT {major} is not supported" if major else "no TensorRT installed"
        for plan in engine_plans(profiles, dims, **options.engine_options):
            lines += describe_plan(plan, dims.num_layers)
            lines.append(f"  precision plan ({installed}):")
            lines += [f"    {describe_precision_plan(precision_plan(options.weights, m))}" for m in majors]
    return DryRun(notes, tuple(lines))


def build_artifact(source: str, profiles, out: str | Path, force: bool = False, status=None,
                   threads: int | None = None, loaded=None, engine_options: dict | None = None,
                   timing_cache: str | Path | None = None, quantization=None, attention: str | None = None,
                   options: BuildOptions | None = None) -> dict:
    """Build an artifact directory (see :mod:`lade_export.artifact`) and return its manifest.

    The options are checked first (:meth:`BuildOptions.check`, the checks and messages of
    ``lade-export build``'s flags), before anything is loaded or written.

    Args:
        source: ``--model`` value (see :mod:`lade_export.export.model_source`).
        profiles: lookahead profiles to record (their shapes bound the engines).
        out: destination directory (written atomically).
        force: replace an existing ``out`` once the new build succeeded.
        status: optional callable ``status(message)`` for progress display; also gets a
            ``note: …`` line when the declared context is capped for the rope variant.
        threads: ONNX Runtime threads for the parity check.
        loaded: an already loaded :class:`~lade_export.export.model_source.LoadedModel` for
            ``source`` (skips loading; used by tests and tools that hold the model).
        engine_options: with TensorRT, keyword arguments of
            :func:`lade_export.export.optimization_profiles.engine_plans` (precision, max_batch,
            max_prompt, max_context, version_compatible, hardware_compatible).
        timing_cache: TensorRT timing cache path, reused across builds.
        quantization: a :class:`lade_export.export.quantize.QuantSpec` for an int8/int4 ONNX
            Runtime graph (``--precision int8|int4``): the float32 graph is exported and
            checked as always, then replaced by its quantized form, whose quality is
            measured and recorded (``quantization`` in the manifest).
        attention: ``onnx-ops``, ``group-query-attention`` or ``auto`` (None: ``auto``;
            :func:`lade_export.export.build_options.choose_attention`); recorded as
            ``graph.attention`` with the cache layout it implies (``graph.kv_cache``).
        options: the build's :class:`~lade_export.export.build_options.BuildOptions` (engine,
            precision, quantization, attention, TensorRT bounds), in place of
            ``engine_options``, ``quantization`` and ``attention`` (which describe the same:
            :meth:`BuildOptions.from_parts`).

    Raises:
        BuildOptionError: options that do not go together, or that the model does not take
            (nothing written); also ``options`` given with ``engine_options``,
            ``quantization`` or ``attention``.
        ModelSourceError, ProfileError, ArtifactError: bad inputs (nothing written).
        CheckFailedError: ONNX-vs-PyTorch parity beyond the float32 bounds, or the graph
            differs from transformers' model at a checked prompt length (nothing written).
        BackendUnavailableError: TensorRT requested but missing (nothing written).
    """
    if options is None:
        options = BuildOptions.from_parts(quantization, engine_options, attention or "auto")
    elif engine_options is not None or quantization is not None or attention is not None:
        raise BuildOptionError("give the build's options either as options= or as engine_options=, quantization= "
                               "and attention=, not both")
    options.check(profiles)  # before any work: nothing is loaded or written
    options.check_timing_cache(timing_cache)
    if options.tensorrt:
        from .tensorrt_build import require_builder

        require_builder()  # nor without TensorRT's builder and a GPU
    quantization, engine_options = options.quantization, options.engine_options
    say = status or (lambda msg: None)
    with atomic_directory(out, force=force) as tmp:
        t0 = time.perf_counter()
        say(f"loading {source}")
        loaded = loaded or load_model(source)
        reference_step = DecoderStep(loaded.model).eval()
        dims = reference_step.dims
        attention = options.attention_for(dims)
        step = reference_step if attention == "onnx-ops" else DecoderStep(loaded.model, attention=attention).eval()
        if step.rope.reason:
            say(f"note: {step.rope.reason}")
        for profile in profiles:
            profile.check_fits(dims.max_context)
        load_s = time.perf_counter() - t0
        say("exporting the decoder step to ONNX")
        t1 = time.perf_counter()
        onnx_path = export_onnx(step, tmp / "model.onnx")
        export_s = time.perf_counter() - t1
        say("checking ONNX Runtime against PyTorch")
        chat = bool(getattr(loaded.tokenizer, "chat_template", None))
        prompt_ids = parity_prompt_ids(loaded.tokenizer, chat)[: max(2, dims.max_context // 2)]
        t2 = time.perf_counter()
        engine = OrtEngine(onnx_path, dims, threads=threads)  # one session for both checks
        cases = check_parity(reference_step, onnx_path, prompt_ids, profiles[0] if profiles else None, engine=engine)
        raise_on_parity(cases)
        parity_s = time.perf_counter() - t2
        say("checking the graph against transformers on both sides of the rope thresholds")
        t3 = time.perf_counter()
        reference = transformers_parity(loaded, onnx_path, step.rope, dims, prompt_ids, engine=engine)
        reference_s = time.perf_counter() - t3
        engine.close()
        engines = []
        if engine_options is not None:
            engines = build_tensorrt_engines(step, onnx_path, tmp, profiles, prompt_ids, engine_options, timing_cache,
                                             say)
        quantized = None
        if quantization is not None:
            ids, label = quality_prompts(loaded.tokenizer, chat)
            quantized = quantize_artifact_graph(tmp, dims, quantization, ids, threads=threads, say=say,
                                                prompts_label=label)
        say("saving the tokenizer and checking it against transformers")
        tokenizer_section = save_tokenizer(loaded.tokenizer, tmp / "tokenizer")
        kv_dtype = quantized["graph"].get("kv_cache_dtype") if quantized is not None else None
        inputs, outputs = step_io_specs(dims.num_layers, dims.kv_heads, dims.head_dim, dims.vocab,
                                        kv_layout=step.kv_layout, kv_dtype=kv_dtype)
        names = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
        tok = loaded.tokenizer
        manifest = Manifest(
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            versions=_versions(),
            source=Source(model=loaded.source, kind=loaded.kind),
            model=ModelInfo(
                architecture="llama",
                dims=dims,
                rope=Rope.from_dict(step.rope.as_dict()),
                stop_token_ids=tuple(loaded.stop_token_ids),
                bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            ),
            graph=GraphInfo(
                file="model.onnx",
                external_data="model.onnx.data" if (tmp / "model.onnx.data").exists() else None,
                opset=17,
                precision=f"int{quantization.bits}" if quantization is not None else "fp32",
                lookahead_exact=quantization.lookahead_exact if quantization is not None else True,
                custom_ops=LIBRARY if quantization is not None and quantization.kernels == "lade" else None,
                mask="bool [batch, 1, step, past+step]; True = may attend; columns = [cache | this step]",
                attention=attention,
                kv_cache=step.kv_layout,
                kv_layout=KV_LAYOUT_TEXT[step.kv_layout].format(dtype=kv_dtype or "float32"),
                inputs=tuple(inputs),
                outputs=tuple(outputs),
            ),
            tokenizer=TokenizerInfo.from_dict(
                {**tokenizer_section, "files": sorted(n for n in names if n.startswith("tokenizer/"))}),
            default_profile=profiles[0].name if profiles else None,
            profiles=tuple(profiles),
            parity=Parity(
                bounds={"max_abs": PARITY_MAX_ABS, "max_rel": PARITY_MAX_REL},
                prompt_tokens=len(prompt_ids),
                cases=tuple(
                    {"label": c.label, "step": c.step, "past": c.past, "max_abs": c.max_abs, "max_logit": c.max_logit,
                     "rel": c.rel, "argmax_equal": c.argmax_equal, "kv_max_abs": c.kv_max_abs}
                    for c in cases
                ),
                transformers=reference,
            ),
            timings_s={"load": round(load_s, 2), "export": round(export_s, 2), "parity": round(parity_s, 2),
                       "transformers_parity": round(reference_s, 2)},
            engines=tuple(EngineEntry.from_dict(e) for e in engines),
            quantization=Quantization.from_dict(quantized) if quantized is not None else None,
            files={name: FileEntry.from_dict(e) for name, e in file_entries(tmp, names).items()},
        ).to_dict()
        write_json_atomic(tmp / "manifest.json", manifest)
        say("done")
    return manifest
