"""The build pipeline: load → rope plan → export → parity (ONNX Runtime vs the PyTorch step;
the graph vs transformers' model on both sides of every rope threshold) → tokenizer →
manifest, atomically."""

from __future__ import annotations

import datetime
import platform
import time
from pathlib import Path

from .. import __version__
from ..artifact import atomic_directory, file_entries, write_json_atomic
from ..backends.onnxruntime import OrtEngine
from ..errors import CheckFailedError
from ..graph import DecoderStep, export_onnx
from .parity import PARITY_MAX_ABS, PARITY_MAX_REL, check_parity
from ..kernels import LIBRARY
from ..manifest import (EngineEntry, FileEntry, GraphInfo, Manifest, ModelInfo, Parity, Quantization, Rope, Source,
                       TokenizerInfo)
from .model_source import load_model
from ..specs import step_io_specs

PARITY_PROMPT = "Once upon a time, a curious engineer wanted to make a small language model decode faster."
#: Text that extends the parity prompt to the lengths of the transformers parity check (repeated as needed).
REFERENCE_TEXT = (
    " She wrote down every step the model took, one token after another, and counted how often the next word was "
    "easy to guess. The old lighthouse keeper said that a long story is only many short ones in a row, so she "
    "tried reading three words ahead. Some days the guesses were right and the work went twice as fast; on other "
    "days the sea was grey, the numbers were stubborn, and she began again from the first line with a cup of tea."
)


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


def parity_prompt_ids(tokenizer, chat: bool) -> list[int]:
    """Token ids of the fixed real prompt used for the build's parity check."""
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": PARITY_PROMPT}], add_generation_prompt=True,
                                            tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return list(tokenizer(PARITY_PROMPT).input_ids)


def reference_token_ids(tokenizer, prompt_ids: list[int], count: int) -> list[int]:
    """``count`` real token ids for the transformers parity check: the parity prompt, then
    :data:`REFERENCE_TEXT` (tokenized without special tokens) repeated as needed."""
    more = list(tokenizer(REFERENCE_TEXT, add_special_tokens=False).input_ids) or [0]
    ids = list(prompt_ids)
    while len(ids) < count:
        ids += more
    return ids[:count]


#: Texts on which the runtime tokenizer must give transformers' ids (plain and chat).
TOKENIZER_SAMPLES = ("Once upon a time", "Hello, world! Don't  stop.\n\tTabs, ünïcödé, 日本語 and 😀🚀.", "  leading spaces",
                     "<s> looks special </s>")


def save_tokenizer(hf_tokenizer, folder: Path) -> dict:
    """Save the tokenizer for the runtime and check that the runtime reads it right.

    Writes ``folder/tokenizer.json`` (and transformers' own files beside it), then
    encodes :data:`TOKENIZER_SAMPLES` — plain, and as one chat turn when there is a chat
    template — with :class:`lade_export.tokenizer.Tokenizer` and with transformers.

    Returns:
        the manifest's ``tokenizer`` section (without ``files``): ``dir``, ``file``,
        ``chat_template`` (text or None), ``special_tokens``, ``checked_samples``.

    Raises:
        ModelSourceError: the checkpoint has only a slow (Python) tokenizer.
        CheckFailedError: the runtime tokenizer's ids differ from transformers' (naming the sample).
    """
    from ..errors import ModelSourceError
    from ..tokenizer import Tokenizer

    hf_tokenizer.save_pretrained(folder)
    if not (folder / "tokenizer.json").is_file():
        raise ModelSourceError("the checkpoint has no fast tokenizer (tokenizer.json); lade-export's runtime needs one")
    template = getattr(hf_tokenizer, "chat_template", None)
    template = template if isinstance(template, str) and template else None
    special = {k: v for k, v in hf_tokenizer.special_tokens_map.items() if isinstance(v, str)}
    ours = Tokenizer(folder / "tokenizer.json", template, special, hf_tokenizer.bos_token_id)
    for text in TOKENIZER_SAMPLES:
        if ours.encode(text) != list(hf_tokenizer(text).input_ids):
            raise CheckFailedError(f"the runtime tokenizer encodes {text!r} differently from transformers")
        if template is not None:
            ref = hf_tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                   tokenize=True)
            ref = list(ref["input_ids"] if hasattr(ref, "keys") else ref)
            if ours.encode_prompt(text, chat=True) != ref:
                raise CheckFailedError(f"the runtime's chat template gives other ids than transformers for {text!r}")
    return {"dir": folder.name, "file": f"{folder.name}/tokenizer.json", "chat_template": template,
            "special_tokens": special, "checked_samples": len(TOKENIZER_SAMPLES)}


def transformers_parity(loaded, onnx_path: Path, plan, dims, prompt_ids: list[int], threads=None, engine=None) -> dict:
    """Compare the graph with transformers' model at the lengths of
    :func:`lade_export.export.rope.reference_lengths` (both sides of every rope threshold).

    Returns:
        the manifest's ``parity.transformers`` section.

    Raises:
        CheckFailedError: a length beyond max |Δlogit| 1e-3 or with another argmax (one line
            naming the length, the rope type and the declared context).
    """
    import transformers

    from .parity import check_against_transformers
    from .rope import reference_lengths

    lengths = reference_lengths(plan, len(prompt_ids))
    token_ids = reference_token_ids(loaded.tokenizer, prompt_ids, max(lengths))
    cases = check_against_transformers(loaded.model, onnx_path, dims, token_ids, lengths, threads=threads,
                                       engine=engine)
    bad = [c for c in cases if not c.ok()]
    if bad:
        c = bad[0]
        raise CheckFailedError(
            f"parity check (ONNX graph vs transformers) failed at {c.label} of {c.tokens} tokens with rope type "
            f"{plan.rope_type!r} (declared context {dims.max_context}): max |Δlogit| {c.max_abs:.3g}, argmax equal "
            f"{c.argmax_equal}")
    return {"reference": f"transformers {transformers.__version__} {type(loaded.model).__name__}",
            "bounds": {"max_abs": PARITY_MAX_ABS, "argmax": "identical"}, "lengths": lengths,
            "cases": [c.as_dict() for c in cases]}


def _raise_on_parity(cases, what: str = "ONNX Runtime vs PyTorch") -> None:
    bad = [c for c in cases if not c.ok()]
    if bad:
        c = bad[0]
        raise CheckFailedError(
            f"parity check ({what}) failed at {c.label} (step {c.step}, past {c.past}): max |Δlogit| {c.max_abs:.3g}, "
            f"relative {c.rel:.3g}, argmax equal {c.argmax_equal}, KV max |Δ| {c.kv_max_abs:.3g}"
        )


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
        _raise_on_parity(check_parity(step, graph, prompt_ids, profile), "sanitized graph")
        graph_parity = None
        dtype = plan_of_precision["graph_dtype"]
        if dtype != "float32":
            from .precision import export_reduced_precision

            say(f"exporting the step in {dtype} for a strongly typed network")
            (Path(scratch) / "reduced").mkdir()
            raw = export_reduced_precision(step, dtype, Path(scratch) / "reduced" / "raw.onnx")
            graph = Path(scratch) / "reduced" / "model.onnx"
            counts = sanitize_onnx(raw, graph)
            graph_parity = _reduced_precision_parity(step, graph, prompt_ids, profile, precision,
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


def _reduced_precision_parity(step, graph: Path, prompt_ids, profile, precision: str, max_abs: float,
                              max_rel: float) -> dict:
    """ONNX Runtime on the reduced-precision graph vs the float32 PyTorch step: every case
    within ``max_abs``/``max_rel`` (max |Δlogit| / max |logit|) with equal argmax at every
    row (bfloat16: not run, see the caller).

    Raises:
        CheckFailedError: a case beyond the bounds, or with another argmax.
    """
    if precision == "bf16":
        return {"checked": False, "reason": "ONNX Runtime has no bfloat16 CPU kernels; lade-export check compares the "
                                            "engines with PyTorch on the GPU"}
    cases = check_parity(step, graph, prompt_ids, profile)
    bad = [c for c in cases if not c.ok(max_abs=max_abs, max_rel=max_rel)]
    if bad:
        c = bad[0]
        raise CheckFailedError(
            f"parity check ({precision} graph vs float32 PyTorch) failed at {c.label} (step {c.step}, past {c.past}): "
            f"max |Δlogit| {c.max_abs:.3g}, relative {c.rel:.3g} (bound {max_rel:g}), argmax equal {c.argmax_equal}")
    return {"checked": True, "max_rel_bound": max_rel,
            "cases": [{"label": c.label, "step": c.step, "past": c.past, "max_abs": c.max_abs, "rel": c.rel,
                       "argmax_equal": c.argmax_equal, "kv_max_abs": c.kv_max_abs} for c in cases]}


def quantize_artifact_graph(root: Path, dims, spec, prompts: list[list[int]], threads=None, say=None) -> dict:
    """Replace ``root/model.onnx`` (float32) by its weight-only quantized form and report
    the quality: top-1 agreement and max |Δlogit| against the float32 graph, teacher-forced
    on the float32 engine's own greedy answers (64 tokens) to ``prompts``.

    Returns:
        the manifest's ``quantization`` section: ``spec``, ``graph`` (sizes, op counts),
        ``quality`` (:func:`lade_export.export.quantize.quality_report`) and, with the lade kernels,
        ``kernels``: ``library``, ``compute``, ``paths`` (those it holds, per compute type) and
        ``path_at_build`` (the one the quality was measured on).
    """
    from .quantize import quality_report, quantize_step_graph
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
        answer = Decoder(reference, [], dims.max_context).generate(ids, min(64, dims.max_context - len(ids)), None)
        sequences.append((list(ids) + answer.token_ids, len(ids)))
    quality = quality_report(reference, quantized, sequences)
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


#: The shipped profile an artifact gets by default, per weight precision: the step-cost
#: curve differs (an int4 step grows with its width much faster than a float32 one), so
#: each precision has its own (measured on CPUs; bench/results/README.md).
DEFAULT_PROFILES = {"fp32": "default", "fp16": "default", "bf16": "default", "int8": "greedy-only",
                    "int4": "default-int4"}


def default_profile_for(precision: str, kernels: str = "onnxruntime") -> str:
    """Name of the shipped profile a build records as its default for ``precision``: with
    the lade kernels (float32 compute, exact lookahead at 8 bits too) int8 gets int4's."""
    if kernels == "lade" and precision in ("int8", "int4"):
        return DEFAULT_PROFILES["int4"]
    return DEFAULT_PROFILES.get(precision, "default")


def quality_prompts(tokenizer, chat: bool, count: int = 4) -> list[list[int]]:
    """Prompt ids for the quantization quality report: the first MT-Bench questions when the
    datasets are at hand, else the build's parity prompt."""
    from ..evaluation.datasets import load_prompts
    from ..errors import GenerationError

    try:
        texts = [p.text for p in load_prompts("mt_bench", limit=count, chat=chat)]
    except GenerationError:
        texts = [PARITY_PROMPT]
    out = []
    for text in texts:
        if chat and getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True)
            out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
        else:
            out.append(list(tokenizer(text).input_ids))
    return out


#: ``graph.kv_layout`` of the manifest: the cache layout in words.
KV_LAYOUT_TEXT = {
    "sequence-major": "[batch, seq, kv_heads, head_dim] (sequence-major), float32, RoPE applied to keys; "
                      "present.* = this step only",
    "head-major-shared": "[batch, kv_heads, capacity, head_dim] (head-major), float32, RoPE applied to keys, filled "
                         "up to past = mask columns - step; present.* = the same buffer with this step written at "
                         "[past, past+step): bind each present output to its past input's memory",
}


def refuse_fused_attention_on_tensorrt(requested: str, tensorrt: bool) -> None:
    """Raise before any work when a TensorRT build asks for ``group-query-attention``.

    Raises:
        ProfileError: ``requested`` is ``group-query-attention`` and ``tensorrt`` is set.
    """
    from ..errors import ProfileError

    if requested == "group-query-attention" and tensorrt:
        raise ProfileError("--attention group-query-attention is an ONNX Runtime contrib op that TensorRT cannot "
                           "parse; --engine tensorrt takes --attention onnx-ops")


def refuse_fused_attention_on_rows_exact(requested: str) -> None:
    """Raise before any work when an int8-compute lade build asks for ``group-query-attention``.

    Raises:
        ProfileError: ``requested`` is ``group-query-attention``.
    """
    from ..errors import ProfileError

    if requested == "group-query-attention":
        raise ProfileError("--compute int8 computes attention with the lade kernels (each row over the keys it sees, "
                           "for exact lookahead), on the onnx-ops graph: drop --attention group-query-attention")


def choose_attention(requested: str, dims, tensorrt: bool = False, rows_exact: bool = False) -> str:
    """The attention formulation of a build (``--attention``).

    ``auto`` picks ``group-query-attention`` — ONNX Runtime's fused RoPE + attention op
    (``com.microsoft.GroupQueryAttention``) over a shared head-major cache buffer, which
    removes the per-layer attention operators and the per-step transposes of the cache —
    for ONNX Runtime builds whose head width it accepts (a multiple of 16), else
    ``onnx-ops`` (standard operators, sequence-major cache; what TensorRT parses).

    ``rows_exact`` (int8-compute lade builds, whose attention becomes the kernels'
    ``AttentionRows``, :func:`lade_export.export.quantize.exact_attention`) takes ``onnx-ops``.

    Raises:
        ProfileError: ``group-query-attention`` asked for a TensorRT build, for ``rows_exact``
            or for a head width of the model that ONNX Runtime's kernel refuses; an unknown value.
    """
    from ..errors import ProfileError
    from ..graph import ATTENTION_KINDS

    fits = dims.head_dim % 16 == 0
    if rows_exact:
        refuse_fused_attention_on_rows_exact(requested)
    if requested == "auto":
        return "group-query-attention" if fits and not tensorrt and not rows_exact else "onnx-ops"
    if requested not in ATTENTION_KINDS:
        raise ProfileError(f"--attention must be auto, {' or '.join(ATTENTION_KINDS)}, got {requested!r}")
    refuse_fused_attention_on_tensorrt(requested, tensorrt)
    if requested == "group-query-attention" and not fits:
        raise ProfileError(f"--attention group-query-attention needs a head width that is a multiple of 16 (ONNX "
                           f"Runtime's kernel); this model's is {dims.head_dim}: use --attention onnx-ops")
    return requested


def build_artifact(source: str, profiles, out: str | Path, force: bool = False, status=None,
                   threads: int | None = None, loaded=None, engine_options: dict | None = None,
                   timing_cache: str | Path | None = None, quantization=None, attention: str = "auto") -> dict:
    """Build an artifact directory (see :mod:`lade_export.artifact`) and return its manifest.

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
        attention: ``onnx-ops``, ``group-query-attention`` or ``auto``
            (:func:`choose_attention`); recorded as ``graph.attention`` with the cache
            layout it implies (``graph.kv_cache``).

    Raises:
        ModelSourceError, ProfileError, ArtifactError: bad inputs (nothing written).
        CheckFailedError: ONNX-vs-PyTorch parity beyond the float32 bounds, or the graph
            differs from transformers' model at a checked prompt length (nothing written).
        BackendUnavailableError: TensorRT requested but missing (nothing written).
    """
    say = status or (lambda msg: None)
    with atomic_directory(out, force=force) as tmp:
        t0 = time.perf_counter()
        say(f"loading {source}")
        loaded = loaded or load_model(source)
        reference_step = DecoderStep(loaded.model).eval()
        dims = reference_step.dims
        attention = choose_attention(attention, dims, tensorrt=engine_options is not None,
                                     rows_exact=quantization is not None and quantization.kernels == "lade"
                                     and quantization.compute == "int8")
        step = reference_step if attention == "onnx-ops" else DecoderStep(loaded.model, attention=attention).eval()
        if step.rope.reason:
            say(f"note: {step.rope.reason}")
        for profile in profiles:
            profile.check_fits(dims.max_context)
        if quantization is not None and dims.hidden % quantization.block_size:
            from ..errors import ProfileError

            raise ProfileError(f"--block-size {quantization.block_size} does not divide the model's hidden size "
                               f"{dims.hidden}; give a power of two ≥ 16 that does (e.g. 32)")
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
        _raise_on_parity(cases)
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
            quantized = quantize_artifact_graph(tmp, dims, quantization, quality_prompts(loaded.tokenizer, chat),
                                                threads=threads, say=say)
        say("saving the tokenizer and checking it against transformers")
        tokenizer_section = save_tokenizer(loaded.tokenizer, tmp / "tokenizer")
        inputs, outputs = step_io_specs(dims.num_layers, dims.kv_heads, dims.head_dim, dims.vocab,
                                        kv_layout=step.kv_layout)
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
                kv_layout=KV_LAYOUT_TEXT[step.kv_layout],
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
