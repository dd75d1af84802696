"""The TensorRT engine of the decoding loop: it runs the engines ``lade-export build
--engine tensorrt`` built (:mod:`lade_export.export.tensorrt_build` builds them; this
module imports no export code, after Polygraphy's loader/runner split).

It deserializes each engine when first used, gives each request the engine whose
optimization profiles cover its lookahead steps and each step the optimization profile
that covers its shapes, binds inputs and outputs (the KV cache kept on the GPU) and
runs, on the TensorRT 10 and 11 Python APIs (named I/O tensors, ``set_input_shape``,
``set_tensor_address``, ``execute_async_v3``, ``set_optimization_profile_async``).
Which TensorRT is installed, and whether it runs an engine, is
:mod:`lade_export.backends.tensorrt_install`'s answer: the full ``tensorrt`` module, or
the lean runtime (``tensorrt_lean``, PyPI's ``tensorrt-lean`` wheels; also
``tensorrt_dispatch``), which runs only ``--version-compatible`` engines. Device buffers
go through :mod:`lade_export.backends.cuda` (``cuda-bindings``), so a service runs
engines with the lean runtime, numpy and nothing else — no PyTorch. ``lade-export
check`` runs its feeds through this engine too (:mod:`lade_export.export.check`).

TensorRT is optional: it is imported only inside functions. No TensorRT and no GPU exist
where this was written; every line runs in CI against a test double of the TensorRT API
(``tests/trt_double.py``) that enforces the API's rules and computes real outputs with
ONNX Runtime — it complements, never replaces, a real run.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from ..errors import ArtifactError, BackendUnavailableError, EngineError, GenerationError, ProfileError
from .cuda import grow_buffer
from .tensorrt_install import check_engine_entry, import_runtime


class _Plan:
    """One engine of the manifest: its optimization-profile shapes, and once used, the
    deserialized ``ICudaEngine`` and an execution context per optimization profile."""

    def __init__(self, root: Path, entry):
        self.entry = entry  # a lade_export.manifest.EngineEntry
        self.name = entry.lookahead_profile.name
        self.path = root / entry.file
        self.phases = list(entry.optimization_profiles)  # index = optimization profile index
        self.shapes = entry.optimization_profiles
        decode = self.shapes["decode"]
        self.decode_step = decode["input_ids"]["max"][1]
        self.decode_rows = decode["logits_positions"]["max"][1]
        self.max_past = decode["past_key_values.0.key"]["max"][1]
        self.max_prompt = self.shapes["prefill"]["input_ids"]["max"][1]
        self.engine = None
        self.contexts: dict[int, object] = {}
        self.inputs: list[str] = []
        self.outputs: list[str] = []
        self.dtypes: dict[str, np.dtype] = {}

    def covers(self, index: int, shapes: dict) -> bool:
        """Whether optimization profile ``index`` admits every input shape in ``shapes``."""
        for name, s in self.shapes[self.phases[index]].items():
            shape = shapes.get(name)
            if shape is None or len(shape) != len(s["min"]):
                return False
            if any(not lo <= d <= hi for d, lo, hi in zip(shape, s["min"], s["max"])):
                return False
        return True

    def limits(self) -> str:
        packed = self.shapes.get("packed")
        rows = f"; packed passes ≤ {packed['input_ids']['max'][1]} rows, pool ≤ " \
               f"{packed['past_key_values.0.key']['max'][1]}" if packed else ""
        return (f"{self.name} (prefill ≤ {self.max_prompt} tokens; decode steps ≤ {self.decode_step} tokens, "
                f"≤ {self.decode_rows} logit rows, cache ≤ {self.max_past}{rows})")


class TensorRTEngine:
    """Runs the TensorRT engines built by ``lade-export build --engine tensorrt``.

    Every step goes to the engine and optimization profile that cover its shapes: an
    empty cache tries the prefill optimization profile (0) first, a step with a cache the
    decode one (1), then the packed one (2, the scheduler's passes, in engines built with
    it: :mod:`lade_export.export.optimization_profiles`). A request's engine is what
    :meth:`check_profile` returns for its lookahead profile — the engine whose decode
    optimization profile covers its largest step with the fewest tokens to spare — and
    the request passes that name with each of its steps (``run(..., plan=name)``): that
    engine is tried first, then the loaded ones, then the smallest. The choice travels
    with the request, never as state of this object, so concurrent requests of different
    lookahead profiles each run on their own engine; a step without a plan (greedy, a
    scheduler's packed pass) goes to a loaded engine that covers it if any. Any covering
    engine computes the same step; the order only saves memory and keeps steps near an
    engine's tuned shapes. Engines are deserialized when first used, with one execution
    context per (engine, optimization profile); ``run`` holds a lock, so one object
    serves several threads.

    Args:
        artifact: an opened :class:`lade_export.artifact.Artifact` with ``engines`` entries.
        engine: only this engine (by its lookahead profile's name; ``lade-export check``
            checks each); None: all of them.
        device: ``cuda`` or ``cuda:N`` (TensorRT runs on a GPU; anything else means cuda:0).
        runtime: ``full``, ``lean`` or ``dispatch``; None: the first installed
            (:data:`lade_export.backends.tensorrt_install.RUNTIME_MODULES`). The lean and
            dispatch runtimes run only engines built with ``--version-compatible``.

    Attributes:
        runtime_kind: ``full``, ``lean`` or ``dispatch``; ``runtime_description`` says
            which module and version run the engines.
        kv_layout: ``"sequence-major"`` (TensorRT builds keep the standard attention operators).
        step_room: None (no rotary table past the context).
        attention_skips: 0 (attention spans every column).

    Raises:
        BackendUnavailableError: no TensorRT runtime, no CUDA wrapper or GPU, an
            unsupported version, or a lean runtime with engines that are not
            version-compatible.
        ArtifactError: no engines in the manifest, an unknown ``engine``, or engines built
            for another GPU or TensorRT version.
    """

    name = "tensorrt"
    kv_layout = "sequence-major"
    kv_dtype = np.dtype(np.float32)  # host caches in float32 (runtime.Engine)
    step_room = None
    attention_skips = 0

    def __init__(self, artifact, engine: str | None = None, device: str = "cuda", runtime: str | None = None):
        from .cuda import CudaDevice, cuda_unavailable_reason

        entries = list(artifact.spec.engines)
        if not entries:
            raise ArtifactError(f"{artifact.root} has no TensorRT engines; build it with --engine tensorrt")
        if engine is not None:
            names = [e.lookahead_profile.name if e.lookahead_profile else e.file for e in entries]
            entries = [e for e in entries if e.lookahead_profile is not None and e.lookahead_profile.name == engine]
            if not entries:
                raise ArtifactError(f"{artifact.root} has no TensorRT engine {engine!r}; it has {', '.join(names)}")
        self.trt, self.runtime_kind = import_runtime(runtime)
        self.version = str(self.trt.__version__)
        reason = cuda_unavailable_reason()  # before trt.Runtime, which crashes the process without a GPU
        if reason:
            raise BackendUnavailableError(f"TensorRT is installed but {reason}")
        index = int(device.split(":", 1)[1]) if device.startswith("cuda:") else 0
        self.cuda = CudaDevice(index)
        self.dims = artifact.dims
        capability = self.cuda.compute_capability
        for e in entries:
            check_engine_entry(e, self.trt, self.runtime_kind, capability)
        self.plans = [_Plan(artifact.root, e) for e in entries]
        self.max_prompt = max(p.max_prompt for p in self.plans)
        self.max_context = max(p.max_past for p in self.plans) + 1
        self.runtime_description = (f"TensorRT {self.version} {self.runtime_kind} runtime ({self.trt.__name__}) on GPU "
                                    f"{index} (compute capability {capability})")
        self._runtime = None
        self._buffers: dict[str, object] = {}
        self._mirrors: dict[int, object] = {}  # id(KVCache) -> its KVMirror (device copy of the cache)
        self._latest = None  # (present.0.key returned by the latest run, its present device buffers)
        self._lock = threading.Lock()

    # -- engines and contexts ------------------------------------------------------------

    def _trt_runtime(self):
        if self._runtime is None:
            trt = self.trt
            self._runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
            # Version-compatible plans carry host code (their lean runtime); the manifest
            # lists them with size and sha256, checked when the artifact was opened.
            self._runtime.engine_host_code_allowed = True
        return self._runtime

    def _load(self, plan: _Plan) -> None:
        trt = self.trt
        engine = self._trt_runtime().deserialize_cuda_engine(plan.path.read_bytes())
        if engine is None:
            raise ArtifactError(f"TensorRT {self.version} ({self.runtime_kind} runtime) cannot deserialize "
                                f"{plan.entry.file}; see the TensorRT log above")
        numpy_of = {trt.float32: np.float32, trt.float16: np.float16, trt.int64: np.int64, trt.int32: np.int32,
                    trt.bool: np.bool_}
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        for name in names:
            dtype = engine.get_tensor_dtype(name)
            if dtype not in numpy_of:
                raise ArtifactError(f"{plan.entry.file}: I/O tensor {name} is {dtype}; the runtime exchanges "
                                    "float32, int64 and bool tensors (rebuild the engine)")
            plan.dtypes[name] = np.dtype(numpy_of[dtype])
        plan.inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        plan.outputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        if engine.num_optimization_profiles != len(plan.phases):
            raise ArtifactError(f"{plan.entry.file} has {engine.num_optimization_profiles} optimization profiles; "
                                f"the manifest lists {len(plan.phases)} ({', '.join(plan.phases)})")
        plan.engine = engine

    def _context(self, plan: _Plan, index: int):
        if plan.engine is None:
            self._load(plan)
        ctx = plan.contexts.get(index)
        if ctx is None:
            ctx = plan.engine.create_execution_context()
            if ctx is None:
                raise EngineError(f"TensorRT cannot create an execution context for {plan.entry.file} "
                                  "(out of GPU memory?)")
            if not ctx.set_optimization_profile_async(index, self.cuda.stream_handle):
                raise EngineError(f"TensorRT cannot select optimization profile {index} ({plan.phases[index]}) of "
                                  f"{plan.entry.file}")
            self.cuda.synchronize()
            plan.contexts[index] = ctx
        return ctx

    def select(self, feeds: dict, plan: str | None = None):
        """``(plan, optimization profile index)`` whose shapes cover ``feeds``, None if none.

        Args:
            feeds: the step's inputs (only their shapes are read).
            plan: the name of the engine to try first (what :meth:`check_profile` returned
                for the request's lookahead profile), or None.

        Order: the engine named ``plan``, then the loaded engines, then the smallest decode
        step; within an engine the prefill optimization profile first for an empty cache,
        else the decode one, then packed.

        Raises:
            GenerationError: ``plan`` names no engine of this object.
        """
        if plan is not None and all(p.name != plan for p in self.plans):
            raise GenerationError(f"no TensorRT engine {plan!r} here (engines: {', '.join(p.name for p in self.plans)})")
        shapes = {k: tuple(np.shape(v)) for k, v in feeds.items()}
        past = shapes.get("past_key_values.0.key", (0, 0, 0))[1]
        plans = sorted(self.plans, key=lambda p: (p.name != plan, p.engine is None, p.decode_step))
        preference = ("prefill", "decode", "packed") if past == 0 else ("decode", "packed", "prefill")
        for candidate in plans:
            order = sorted(range(len(candidate.phases)), key=lambda i: preference.index(candidate.phases[i])
                           if candidate.phases[i] in preference else 9)
            for index in order:
                if candidate.covers(index, shapes):
                    return candidate, index
        return None

    @property
    def packed_limits(self) -> tuple[int, int] | None:
        """``(rows, pool tokens)`` the engines' packed optimization profiles cover (the
        largest of them), None when no engine has one (built before batching existed)."""
        limits = [(p.shapes["packed"]["input_ids"]["max"][1], p.shapes["packed"]["past_key_values.0.key"]["max"][1] + 1)
                  for p in self.plans if "packed" in p.shapes]
        return max(limits) if limits else None

    def check_batching(self, token_budget: int, prefill_chunk: int, kv_tokens: int) -> None:
        """Refuse continuous batching whose passes no engine's packed optimization
        profile covers.

        Args:
            token_budget, prefill_chunk, kv_tokens: the scheduler's options
                (:class:`lade_export.scheduler.Scheduler`).

        Raises:
            GenerationError: no engine has a packed optimization profile (rebuild), or
                the options exceed its rows or pool tokens.
        """
        limits = self.packed_limits
        if limits is None:
            raise GenerationError("batching=True needs TensorRT engines with a packed optimization profile; these were "
                                  "built before batching existed: rebuild with --engine tensorrt")
        rows, tokens = limits
        if max(token_budget, prefill_chunk) > rows or kv_tokens > tokens:
            raise GenerationError(f"the scheduler's passes (token budget {token_budget}, prefill chunk "
                                  f"{prefill_chunk}, pool of {kv_tokens} tokens) exceed the TensorRT engines' packed "
                                  f"optimization profile ({rows} rows, {tokens} pool tokens): give the scheduler "
                                  "smaller options (Scheduler(model.decoder, token_budget=…, prefill_chunk=…, "
                                  "kv_tokens=…)) or rebuild the engines with a larger --max-context")

    def optimization_profile_for(self, feeds: dict, plan: str | None = None) -> str | None:
        """``"ENGINE:PHASE"`` that :meth:`run` would use for ``feeds`` with ``plan`` (None: not covered)."""
        chosen = self.select(feeds, plan)
        return f"{chosen[0].name}:{chosen[0].phases[chosen[1]]}" if chosen else None

    def check_profile(self, profile) -> str:
        """Refuse a lookahead profile whose largest step no engine's decode optimization
        profile covers (called by :meth:`lade_export.runtime.Decoder.check_request`), else
        choose its engine.

        Returns:
            the name of the engine whose decode optimization profile covers the lookahead
            profile's largest step and logit rows with the fewest tokens to spare: the
            request's ``plan`` for :meth:`run`. Nothing is kept here.

        Raises:
            ProfileError: naming the lookahead profile, its largest step and each engine's
                limits.
        """
        fits = [p for p in self.plans if p.decode_step >= profile.max_step and p.decode_rows >= profile.max_logit_rows]
        if fits:
            return min(fits, key=lambda p: p.decode_step).name
        have = "; ".join(f"{p.name}: steps ≤ {p.decode_step}, ≤ {p.decode_rows} logit rows" for p in self.plans)
        raise ProfileError(
            f"profile {profile.name!r} needs steps of up to {profile.max_step} tokens ({profile.max_logit_rows} logit "
            f"rows), more than any TensorRT engine here covers ({have}); rebuild with --engine tensorrt --profile "
            f"{profile.name}")

    # -- running -------------------------------------------------------------------------

    def _mirror(self, plan: _Plan, feeds: dict):
        """``(cache, its device copy)`` for the host cache behind ``feeds``
        (:func:`~lade_export.backends.cuda.mirror_for`), or ``(None, None)`` when the feeds
        do not come from a :class:`~lade_export.kv_cache.KVCache` of batch 1 the engine can
        mirror (then the cache is uploaded whole, as any input)."""
        from ..kv_cache import owner_of
        from .cuda import mirror_for

        names = [n for n in plan.inputs if n.startswith("past_key_values.")]
        cache = owner_of(feeds.get(names[0])) if names else None
        if cache is None or cache.layout != "sequence-major" or np.shape(feeds[names[0]])[0] != 1:
            return None, None
        layer = {n: cache.keys[i] if n.endswith(".key") else cache.values[i]
                 for n in names for i in [int(n.split(".")[1])]}
        if any(getattr(feeds[n], "base", None) is not layer[n] or plan.dtypes[n] != np.float32 for n in names):
            return None, None
        return cache, mirror_for(self._mirrors, self.cuda, cache, names)

    def run(self, feeds: dict, with_logits: bool = False, plan: str | None = None) -> dict:
        """One forward pass; same contract as the ONNX Runtime engine (numpy in, numpy out,
        ``logits`` only when ``with_logits`` — it is then the only output not copied back
        otherwise). ``plan``: the engine to try first (the request's, from
        :meth:`check_profile`; see :meth:`select`), None to choose by the shapes alone.

        The KV cache stays on the GPU: when the ``past_key_values.*`` feeds are a
        :class:`~lade_export.kv_cache.KVCache`'s (batch 1, as the decoding loop and the
        scheduler's pool pass them), the engine binds a device copy of that cache
        (:class:`~lade_export.backends.cuda.KVMirror`), kept in step by copying the rows
        each append kept from this engine's ``present.*`` buffers on the device; a step
        then uploads only ``input_ids``, ``position_ids``, ``attention_mask`` and
        ``logits_positions`` (plus the rows of any write the engine did not produce).
        Other feeds (a batch > 1, arrays of no cache) are uploaded whole. Outputs are
        copied back as before (``present.*`` too: the host cache keeps the accepted rows).

        Raises:
            GenerationError: no engine's optimization profiles cover the step (a prompt
                longer than the engines' ``--max-prompt``, a cache beyond their
                ``--max-context``, a larger batch or step), or ``plan`` names no engine here.
            EngineError: TensorRT rejects an input shape or fails to run the step, or a
                CUDA copy fails.
        """
        with self._lock:
            chosen = self.select(feeds, plan)
            if chosen is None:
                step = np.shape(feeds["input_ids"])
                past = np.shape(feeds["past_key_values.0.key"])[1]
                rows = np.shape(feeds["logits_positions"])[1]
                raise GenerationError(
                    f"no TensorRT engine covers a step of {step[1]} tokens (batch {step[0]}) with {past} cached tokens "
                    f"and {rows} logit rows: {'; '.join(p.limits() for p in self.plans)}; rebuild with larger "
                    "--max-prompt/--max-context/--max-batch")
            plan, index = chosen
            ctx = self._context(plan, index)
            where = f"{plan.entry.file} (optimization profile {index}, {plan.phases[index]})"
            cache, mirror = self._mirror(plan, feeds)
            if mirror is not None:
                mirror.sync(cache, feeds, self._latest)
            hold = []
            for name in plan.inputs:
                on_device = mirror is not None and name in mirror.offsets
                array = feeds[name] if on_device else np.ascontiguousarray(feeds[name], dtype=plan.dtypes[name])
                if not ctx.set_input_shape(name, array.shape):
                    s = plan.shapes[plan.phases[index]][name]
                    raise EngineError(f"TensorRT rejected shape {list(array.shape)} of {name} in {where}; the "
                                      f"optimization profile allows {s['min']} to {s['max']}")
                if on_device:
                    address = mirror.address(name)
                else:
                    buf = grow_buffer(self.cuda, self._buffers, name, array.nbytes)
                    self.cuda.upload(buf, array)
                    hold.append(array)
                    address = buf.ptr
                if not ctx.set_tensor_address(name, address):
                    raise EngineError(f"TensorRT rejected the device address of {name} in {where}")
            outputs = {}
            for name in plan.outputs:
                shape = tuple(ctx.get_tensor_shape(name))
                if any(d < 0 for d in shape):
                    raise EngineError(f"TensorRT could not infer the shape of output {name} in {where}: {list(shape)}")
                host = np.empty(shape, plan.dtypes[name])
                buf = grow_buffer(self.cuda, self._buffers, name, host.nbytes)
                if not ctx.set_tensor_address(name, buf.ptr):
                    raise EngineError(f"TensorRT rejected the device address of {name} in {where}")
                outputs[name] = (host, buf)
            self._latest = None  # the present buffers are about to be overwritten
            if not ctx.execute_async_v3(self.cuda.stream_handle):
                self.cuda.synchronize()
                raise EngineError(f"TensorRT failed to run {where} on a step of {np.shape(feeds['input_ids'])[1]} "
                                  f"tokens with {np.shape(feeds['past_key_values.0.key'])[1]} cached; see the "
                                  "TensorRT log above")
            result = {}
            for name, (host, buf) in outputs.items():
                if with_logits or name != "logits":
                    self.cuda.download(host, buf)
                    result[name] = host
            self.cuda.synchronize()
            del hold
            result = {n: a.astype(np.float32) if a.dtype == np.float16 else a for n, a in result.items()}
            source = result.get("present.0.key")
            if source is not None and all(plan.dtypes.get(n) == np.float32 for n in outputs if n.startswith("present.")):
                # What an append of these outputs copied is still in the present buffers until the next run.
                self._latest = (source, {f"past_key_values.{n[len('present.'):]}": (buf, 0)
                                         for n, (_, buf) in outputs.items() if n.startswith("present.")})
        return result

    @property
    def loaded_engines(self) -> list[str]:
        """Names of the engines deserialized so far."""
        return [p.name for p in self.plans if p.engine is not None]

    def close(self) -> None:
        """Release contexts, engines, device buffers and the stream (idempotent)."""
        with self._lock:
            for plan in self.plans:
                plan.contexts.clear()
                plan.engine = None
            self._runtime = None
            self._buffers.clear()
            self._mirrors.clear()
            self._latest = None
            self.cuda.close()
