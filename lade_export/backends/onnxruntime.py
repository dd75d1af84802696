"""ONNX Runtime engine for the exported decoder step (CPU, or the CUDA execution provider)."""

from __future__ import annotations

import threading
import weakref
from pathlib import Path

import numpy as np

from ..errors import ArtifactError, BackendUnavailableError, EngineError, GenerationError, ProfileError
from ..kv_cache import StackedPresents, cache_of_feeds
from ..specs import ModelDims, past_key_name, past_value_name, present_key_name, present_value_name


#: I/O bindings of distinct cache buffer sets an engine keeps (one per concurrent request
#: is enough; older ones are dropped).
KEPT_BINDINGS = 16

#: Bound step shapes kept per cache on the bound-buffer path (:meth:`OrtEngine.run`): a
#: request's steps come in a few widths (one token, its profile's step, narrower ones), a
#: scheduler's pool's passes in more (one to ``max_batch`` decode steps, with prompt chunks).
#: A shape is bound the second time it is seen (binding costs about what 2 steps' inputs
#: cost), so one-off shapes (a prefill, a pass with a prompt chunk) run on views.
KEPT_SHAPES = 32

#: Most bytes of one bound shape's own arrays (its widened mask, step rows × (bound columns
#: + step), and its logits, n_logits × vocab float32, when the step reads them); a step that
#: needs more (a long prompt's prefill, a sampled step with many logit rows) runs on views.
KEPT_STEP_BYTES = 1 << 20

#: Most bytes of the bound shapes' own arrays kept per cache (the oldest shapes are dropped).
KEPT_CACHE_BYTES = 8 << 20

#: The step graph's inputs besides the cache (:mod:`lade_export.specs`).
SMALL_INPUTS = ("input_ids", "position_ids", "logits_positions", "attention_mask")


def bound_columns(length: int, capacity: int) -> int:
    """Cache columns a step over ``length`` cached tokens binds on the bound-buffer path: the
    multiple of 256 above ``length``, at most ``capacity`` (a pool's unused room costs each
    row a scan of the mask, so a history binds the prefix of its buffers that holds it, and
    a binding serves 256 tokens of a growing history)."""
    return min(capacity, (int(length) // 256 + 1) * 256)


class _BoundStep:
    """One step shape of one cache on the bound-buffer path: an ONNX Runtime ``IOBinding``
    whose ``past_key_values.*`` inputs are the first ``columns`` columns of the cache's
    buffers ([1, columns, kv_heads, head_dim], the cache's dtype) and whose other inputs
    (``input_ids``, ``position_ids`` int64 [1, step], ``attention_mask`` bool [1, 1, step,
    columns + step], ``logits_positions`` int64 [1, n_logits]) and outputs are arrays of
    this object, bound once; a step copies its small inputs into them and runs. A stacked
    cache's (the scheduler's pool; a single request's sequence-major cache) ``present.*``
    outputs are the views of one :class:`~lade_export.kv_cache.StackedPresents` block, which
    the cache stores in one copy."""

    def __init__(self, session, cache, columns: int, step: int, n_logits: int, with_logits: bool, vocab: int,
                 kv_dtype):
        self.columns = columns
        self.input_ids = np.zeros((1, step), np.int64)
        self.position_ids = np.zeros((1, step), np.int64)
        self.mask = np.zeros((1, 1, step, columns + step), bool)
        self.logits_positions = np.zeros((1, n_logits), np.int64)
        self.outputs = {"next_token_ids": np.zeros((1, n_logits), np.int64)}
        if with_logits:
            self.outputs["logits"] = np.zeros((1, n_logits, vocab), np.float32)
        binding = session.io_binding()
        # a stacked cache's presents are views of one block (its kept rows are then stored in one copy)
        self.presents = StackedPresents(len(cache.keys), step, cache.keys[0].shape[2:], kv_dtype) \
            if cache.stacked else None
        for i, (keys, values) in enumerate(zip(cache.keys, cache.values)):
            for name, buffer in ((past_key_name(i), keys), (past_value_name(i), values)):
                binding.bind_input(name, "cpu", 0, kv_dtype, (1, columns, *buffer.shape[2:]), buffer.ctypes.data)
            for name in (present_key_name(i), present_value_name(i)):
                self.outputs[name] = self.presents.views[name] if self.presents is not None \
                    else np.zeros((1, step, *keys.shape[2:]), kv_dtype)
        for name in ("input_ids", "position_ids", "logits_positions"):
            array = getattr(self, name)
            binding.bind_input(name, "cpu", 0, array.dtype, array.shape, array.ctypes.data)
        binding.bind_input("attention_mask", "cpu", 0, bool, self.mask.shape, self.mask.ctypes.data)
        for name, array in self.outputs.items():
            binding.bind_output(name, "cpu", 0, array.dtype, array.shape, array.ctypes.data)
        self.binding = binding
        #: bytes of this object's arrays
        self.nbytes = sum(a.nbytes for a in (self.input_ids, self.position_ids, self.mask, self.logits_positions,
                                              *self.outputs.values()))


def cannot_load(path: str | Path, err: BaseException) -> ArtifactError:
    """The one-line refusal of a file that ONNX Runtime (or the dynamic loader, for a custom-op
    library) could not load: ``ONNX Runtime cannot load PATH: REASON``, REASON the first line
    of ``err``'s message with a leading ``PATH: `` (dlopen's form) dropped, so the path is
    said once. Returned, for the caller to raise."""
    said = str(err).splitlines()[0]
    said = said.split(": ", 1)[1] if said.startswith(str(Path(path).resolve()) + ": ") else said
    return ArtifactError(f"ONNX Runtime cannot load {path}: {said}")


def check_graph_dims(inputs, kv_layout: str, dims: ModelDims, manifest: Path) -> None:
    """Raise :class:`ArtifactError` when a session's cache inputs say another shape than
    ``dims`` (a hand-edited manifest, which would fail at the first step with ONNX Runtime's
    message): its layers (``past_key_values.*.key`` inputs) and the fixed KV heads and head
    width of their shape, read per ``kv_layout``. A graph without cache inputs is not checked.

    Args:
        inputs: ``session.get_inputs()`` of an ONNX Runtime session.
        kv_layout: the graph's cache layout (:data:`lade_export.specs.KV_LAYOUTS`).
        dims: the manifest's ``model.dims``.
        manifest: the manifest's path, for the message.
    """
    keys = [i for i in inputs if i.name.startswith("past_key_values.") and i.name.endswith(".key")]
    if not keys:
        return
    shape = next((i.shape for i in keys if i.name == past_key_name(0)), keys[0].shape)
    heads, width = None, None
    if len(shape) == 4:  # [batch, past, kv_heads, head_dim] or, head-major, [batch, kv_heads, capacity, head_dim]
        heads, width = shape[2 if kv_layout == "sequence-major" else 1], shape[3]
    fixed = [(got, want) for got, want in ((heads, dims.kv_heads), (width, dims.head_dim)) if isinstance(got, int)]
    if len(keys) != dims.num_layers or any(got != want for got, want in fixed):
        raise ArtifactError(f"{manifest}: model.dims ({dims.num_layers} layers, {dims.kv_heads} KV heads of "
                            f"{dims.head_dim}) does not match the graph ({len(keys)} layers, {heads} KV heads of "
                            f"{width}); rebuild with lade-export build")


class OrtEngine:
    """Runs the step graph with ONNX Runtime.

    Args:
        onnx_path: the exported ``model.onnx`` (external data beside it is found by ORT).
        dims: the model's shape facts (from the manifest, or the step module at export).
        threads: intra-op threads (None: ORT's default, one per core).
        provider: ``"cpu"`` or ``"cuda"`` (CUDAExecutionProvider, when onnxruntime-gpu is installed).
        custom_ops: a custom-op library the graph needs (an artifact's ``graph.custom_ops``,
            :mod:`lade_export.kernels`), registered with the session; None for none.
        device_kv: keep a ``sequence-major`` graph's KV cache in the provider's device
            memory and run steps through I/O binding (:meth:`run`). None (default): on with
            ``provider="cuda"`` when cuda-bindings sees the GPU (else off, as before), off
            on the CPU; True on the CPU binds host memory through the same code (tests,
            byte accounting: :attr:`device_memory` counts the bytes each way).

    ``run`` may be called from several threads at once (ONNX Runtime sessions allow
    concurrent ``Run`` calls and release the GIL while running; steps on a device-resident
    cache take turns, as they share the device's ``present.*`` buffers).

    Attributes:
        kv_layout: the graph's KV cache layout (:data:`lade_export.specs.KV_LAYOUTS`), read
            from the model's metadata. For ``head-major-shared`` (``GroupQueryAttention``
            graphs) ``run`` takes each ``past_key_values.*`` feed as the cache buffer itself
            (float32 C-contiguous [batch, kv_heads, capacity, head_dim]) and binds the
            matching ``present.*`` output to the same memory, so ONNX Runtime writes this
            step's keys and values into the caller's buffer and copies nothing else.
        kv_dtype: numpy dtype of the graph's ``past_key_values.*`` / ``present.*`` tensors:
            float16 for the integer path's half-precision cache, else float32; ``run``
            converts a cache feed of another dtype (a copy: feeds built by hand).
        step_room: for a ``GroupQueryAttention`` graph, the tokens its rotary table holds
            past the context (model metadata ``step_room``); None for other graphs.
        attention_skips: 16 when the graph's ``AttentionRows`` skip fully masked blocks of
            16 keys (model metadata ``attention_skips_masked``, written by
            :func:`lade_export.export.quantize.quantize_step_graph`), else 0.
        device_memory: where a device-resident cache lives (a
            :class:`~lade_export.backends.cuda.CudaDevice`, or
            :class:`~lade_export.backends.cuda.HostMemory` on the CPU), None when off.
        binds_steps: whether a step on a ``sequence-major``
            :class:`~lade_export.kv_cache.KVCache`'s own views runs bound to its buffers
            (:meth:`_run_bound`: CPU, an attention that skips masked key blocks, no
            device-resident cache); a stacked cache's ``present.*`` are then one block, so a
            request's cache is best one block too (``KVCache(stacked=True)``), its kept rows
            stored in one copy.

    Raises:
        ArtifactError: the model file or the custom-op library is missing, or ORT cannot load them.
        BackendUnavailableError: ``provider="cuda"`` without the CUDA execution provider, a
            custom-op library with an ONNX Runtime older than the 1.29 its API needs, or a
            ``$LADE_KERNELS_PATH`` that the library cannot honour (unknown, or this CPU lacks it).
    """

    name = "ort"

    def __init__(self, onnx_path: str | Path, dims: ModelDims, threads: int | None = None, provider: str = "cpu",
                 custom_ops: str | Path | None = None, device_kv: bool | None = None):
        import onnxruntime as ort

        path = Path(onnx_path)
        if not path.is_file():
            raise ArtifactError(f"ONNX model not found: {path}")
        options = ort.SessionOptions()
        if custom_ops is not None:
            if not Path(custom_ops).is_file():
                raise ArtifactError(f"custom-op library not found: {custom_ops}")
            version = tuple(int(v) for v in ort.__version__.split(".")[:2] if v.isdigit())
            if version < (1, 29):
                raise BackendUnavailableError(f"{path.parent} computes with lade kernels, which need onnxruntime>=1.29 "
                                              f"(installed: {ort.__version__}); pip install -U 'onnxruntime>=1.29'")
            from ..kernels import running_path

            try:
                chosen = running_path(custom_ops, "int8")  # a $LADE_KERNELS_PATH it cannot honour: one line, here
            except OSError as err:  # not a loadable library (not ELF, another platform's)
                raise cannot_load(custom_ops, err) from None
            if chosen.startswith("error: "):
                raise BackendUnavailableError(chosen[len("error: "):])
            try:
                options.register_custom_ops_library(str(custom_ops))
            except Exception as err:
                raise cannot_load(custom_ops, err) from None
        if threads:
            options.intra_op_num_threads = threads
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        available = ort.get_available_providers()
        if provider == "cuda":
            if "CUDAExecutionProvider" not in available:
                raise BackendUnavailableError(
                    "ONNX Runtime has no CUDAExecutionProvider here; pip install onnxruntime-gpu (needs an NVIDIA GPU)"
                )
            providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
        else:
            providers = ["CPUExecutionProvider"]
        try:
            self.session = ort.InferenceSession(str(path), options, providers=providers)
        except Exception as err:  # ORT raises its own Fail/InvalidGraph types
            raise cannot_load(path, err) from None
        self.dims = dims
        self._all_outputs = [o.name for o in self.session.get_outputs()]
        self._fast_outputs = [n for n in self._all_outputs if n != "logits"]
        meta = self.session.get_modelmeta().custom_metadata_map
        self.kv_layout = meta.get("kv_layout", "sequence-major")
        inputs = self.session.get_inputs()
        check_graph_dims(inputs, self.kv_layout, dims, path.parent / "manifest.json")
        past_type = next((i.type for i in inputs if i.name == past_key_name(0)), "tensor(float)")
        self.kv_dtype = np.dtype(np.float16 if past_type == "tensor(float16)" else np.float32)
        self.step_room = int(meta["step_room"]) if "step_room" in meta else None
        skips = meta.get("attention_skips_masked", "0")
        self.attention_skips = int(skips) if skips.isdigit() else 0
        self._shared = {}  # past input name -> present output name (head-major-shared)
        self._bindings = {}  # (with_logits, cache buffers) -> IOBinding with those buffers bound (_run_shared)
        self._bindings_lock = threading.Lock()
        # KVCache -> ({(columns, step, n_logits, with_logits): _BoundStep}, {shape seen once: True})
        self._bound = weakref.WeakKeyDictionary()
        self._provider = provider
        self._addresses = {}  # id(cache buffer) -> (weak reference, address)
        if self.kv_layout == "head-major-shared":
            self._shared = {past_key_name(i): present_key_name(i) for i in range(dims.num_layers)}
            self._shared.update({past_value_name(i): present_value_name(i) for i in range(dims.num_layers)})
        self.device_memory = None
        self._bind_device = "cpu"
        if self.kv_layout == "sequence-major" and (device_kv or (device_kv is None and provider == "cuda")):
            from .cuda import CudaDevice, HostMemory, cuda_unavailable_reason

            if provider == "cuda":
                if cuda_unavailable_reason() is None:
                    self.device_memory, self._bind_device = CudaDevice(0), "cuda"
                elif device_kv:
                    raise BackendUnavailableError(f"device_kv needs cuda-bindings: {cuda_unavailable_reason()}")
            else:
                self.device_memory = HostMemory()
        self.binds_steps = bool(self.attention_skips) and self.device_memory is None and provider == "cpu" \
            and self.kv_layout == "sequence-major"
        self._past_names = [n for i in range(dims.num_layers) for n in (past_key_name(i), past_value_name(i))]
        self._past_set = set(self._past_names)
        self._mirrors = {}  # id(KVCache) -> KVMirror
        self._latest = None  # (present.0.key of the latest device step, {past name: (its present buffer, 0)})
        self._device_buffers = {}  # input/output name -> DeviceBuffer of the device steps
        self._device_lock = threading.Lock()

    def check_profile(self, profile) -> None:
        """Refuse a lookahead profile whose widest step the graph cannot take
        (:meth:`lade_export.runtime.Engine.check_profile`).

        Returns:
            None: one graph runs every step.

        Raises:
            ProfileError: a ``group-query-attention`` graph has rotary rows for at most
                ``step_room`` tokens past its context, and the profile's ``max_step`` is wider.
        """
        if self.step_room is not None and profile.max_step > self.step_room:
            raise ProfileError(f"profile {profile.name!r}: its largest step ({profile.max_step} tokens) is wider than "
                               f"this graph takes ({self.step_room}, GroupQueryAttention's rotary table); give a "
                               "smaller W, N or G")
        return None

    def check_batching(self, token_budget: int, prefill_chunk: int, kv_tokens: int) -> None:
        """Accept any scheduler options: the graph's shapes are dynamic (``step_room``
        limits the scheduler's pool itself, :class:`lade_export.scheduler.Scheduler`)."""

    def run(self, feeds: dict, with_logits: bool = False, plan: str | None = None) -> dict:
        """One forward pass. ``feeds``: numpy arrays by input name. Returns numpy arrays by
        output name; ``logits`` only when ``with_logits`` (the decoder reads ``next_token_ids``).
        ``plan`` is ignored (one graph runs every step; :meth:`check_profile` returns None).

        On a CPU session of a graph whose attention skips masked key blocks
        (:attr:`attention_skips`), feeds whose cache is a :class:`~lade_export.kv_cache.KVCache`'s
        own views run on I/O bindings of the cache's buffers kept from step to step (the same
        bits; ``present.*`` are then arrays that the cache's next step of the same shape
        overwrites, so keep what you need of them before it).

        Raises:
            EngineError: ONNX Runtime failed to run the feeds (first line of its message).
            GenerationError: the engine was closed (:meth:`close`).
        """
        self._open_session()
        if self._shared:
            return self._run_shared(feeds, with_logits)
        if self.device_memory is not None:
            from ..kv_cache import owner_of

            cache = owner_of(feeds.get(past_key_name(0)))
            if cache is not None and cache.layout == "sequence-major" and np.shape(feeds["input_ids"])[0] == 1 \
                    and all(getattr(feeds[n], "base", None) is (cache.keys if n.endswith(".key") else cache.values)[
                        int(n.split(".")[1])] for n in self._past_names):
                return self._run_device(feeds, with_logits, cache)
        if self.binds_steps:
            owned = cache_of_feeds(feeds)
            if owned is not None and owned[0].dtype == self.kv_dtype and self._bindable(feeds):
                cache, length = owned
                columns = bound_columns(length, cache.capacity)
                step, n_logits = feeds["input_ids"].shape[1], feeds["logits_positions"].shape[1]
                logits = n_logits * self.dims.vocab * 4 if with_logits else 0
                if step * (columns + step) + logits <= KEPT_STEP_BYTES:
                    out = self._run_bound(feeds, with_logits, cache, length, columns, step, n_logits)
                    if out is not None:
                        return out
        names = self._all_outputs if with_logits else self._fast_outputs
        # a cache of another float type (feeds made by hand, float32 by default) is converted, a copy;
        # the runtime's own caches are allocated in kv_dtype and pass as they are
        feeds = {k: np.ascontiguousarray(v, dtype=self.kv_dtype if k in self._past_set else None)
                 for k, v in feeds.items()}
        try:
            return dict(zip(names, self.session.run(names, feeds)))
        except Exception as err:  # onnxruntime's Fail / InvalidArgument
            raise EngineError(f"ONNX Runtime step failed: {str(err).splitlines()[0]}") from None

    def _open_session(self):
        """The ONNX Runtime session. Raises GenerationError once :meth:`close` has run."""
        session = self.session
        if session is None:
            raise GenerationError("the model was closed (Model.close); load it again to decode")
        return session

    @staticmethod
    def _bindable(feeds: dict) -> bool:
        """Whether the small inputs are what a bound step copies without converting: int64
        ``input_ids``, ``position_ids`` [1, step] and ``logits_positions`` [1, n], a bool mask
        [1, 1, step, ·]. Other feeds (another dtype, a missing input, batch > 1) take the
        views path, where ONNX Runtime accepts or refuses them as it always has."""
        ids, positions, rows, mask = (feeds.get(n) for n in SMALL_INPUTS)
        return all(isinstance(a, np.ndarray) and a.dtype == np.int64 and a.ndim == 2 and a.shape[0] == 1
                   for a in (ids, positions, rows)) and positions.shape == ids.shape \
            and isinstance(mask, np.ndarray) and mask.dtype == np.bool_ and mask.ndim == 4 \
            and mask.shape[:3] == (1, 1, ids.shape[1])

    def _run_bound(self, feeds: dict, with_logits: bool, cache, length: int, columns: int, step: int,
                   n_logits: int) -> dict | None:
        """``run`` for feeds whose cache is a ``sequence-major`` :class:`~lade_export.kv_cache.KVCache`'s
        own views of ``length`` tokens (:func:`~lade_export.kv_cache.cache_of_feeds`) on a graph
        whose attention skips masked key blocks (:attr:`attention_skips`), a step of ``step`` rows
        reading ``n_logits`` logit rows: the first ``columns`` columns of the cache's buffers
        (:func:`bound_columns`) are the past inputs, bound once per cache and step shape
        (:class:`_BoundStep`), and the mask is widened to them — the given mask's cache
        columns ``[0, length)``, then False up to ``columns``, then its step columns. Masked keys add nothing to a row's bits (``tests/test_kernels.py``), so the
        outputs are the bits the views give; what it saves is ONNX Runtime taking 60-odd new
        input arrays and allocating every output at each step (greedy decoding of SmolLM2's
        int4 build ran 1.04× as fast: ``bench/bound_cache.py``, ``bench/results/README.md``).

        Returns ``next_token_ids`` (and ``logits``) as new arrays, and the ``present.*``
        outputs as the bound arrays, which the next step of the same cache and shape
        overwrites (callers copy the rows they keep at once: ``KVCache.append``); None the
        first time the cache has a step of this shape (the caller runs it on the views).

        Raises:
            EngineError: the mask is not [1, 1, step, length + step], or ONNX Runtime failed.
            GenerationError: the engine was closed (:meth:`close`).
        """
        mask = feeds["attention_mask"]
        if np.shape(mask) != (1, 1, step, length + step):
            raise EngineError(f"attention_mask is {list(np.shape(mask))}, not [1, 1, {step}, {length + step}] "
                              f"for {length} cached tokens and a step of {step}")
        session = self._open_session()  # close() may have run since run() looked
        key = (columns, step, n_logits, bool(with_logits))
        with self._bindings_lock:
            shapes = self._bound.get(cache)
            if shapes is None:
                shapes = self._bound[cache] = ({}, {})  # (bound shapes, shapes seen once)
            bound = shapes[0].pop(key, None)
            if bound is None and shapes[1].pop(key, None) is None:
                shapes[1][key] = True
                while len(shapes[1]) > KEPT_SHAPES:
                    shapes[1].pop(next(iter(shapes[1])))
                return None
        if bound is None:
            bound = _BoundStep(session, cache, columns, step, n_logits, with_logits, self.dims.vocab, self.kv_dtype)
        bound.input_ids[...] = feeds["input_ids"]
        bound.position_ids[...] = feeds["position_ids"]
        bound.logits_positions[...] = feeds["logits_positions"]
        widened = bound.mask
        widened[..., :length] = mask[..., :length]
        widened[..., length:columns] = False
        widened[..., columns:] = mask[..., length:]
        try:
            session.run_with_iobinding(bound.binding)
        except Exception as err:  # onnxruntime's Fail / InvalidArgument
            raise EngineError(f"ONNX Runtime step failed: {str(err).splitlines()[0]}") from None
        out = dict(bound.outputs)
        out["next_token_ids"] = out["next_token_ids"].copy()
        if with_logits:
            out["logits"] = out["logits"].copy()
        with self._bindings_lock:
            kept = shapes[0]
            kept[key] = bound
            while len(kept) > KEPT_SHAPES or (len(kept) > 1 and sum(b.nbytes for b in kept.values())
                                                  > KEPT_CACHE_BYTES):
                kept.pop(next(iter(kept)))  # the least recently run
        return out

    def _run_shared(self, feeds: dict, with_logits: bool) -> dict:
        """``run`` for a ``head-major-shared`` graph: each cache buffer is bound as its past
        input and as its present output (I/O binding), so the step writes into it in place.
        Returns ``next_token_ids`` (and ``logits``) plus the buffers under the present names.

        The cache bindings of a set of buffers are made once and kept (an ONNX Runtime
        ``IOBinding`` per set, up to :data:`KEPT_BINDINGS`, taken out while a step runs so
        that threads never share one): a step binds only its small inputs and outputs."""
        out, small, pointers = {}, {}, []
        for name, value in feeds.items():
            present = self._shared.get(name)
            if present is None:
                small[name] = value
                continue
            pointers.append((name, self._buffer_address(name, value), value.shape))
            out[present] = value
        key = (with_logits, *pointers)  # a binding never holds a logits output that a step does not fill
        with self._bindings_lock:
            binding = self._bindings.pop(key, None)
        if binding is None:
            binding = self.session.io_binding()
            for name, pointer, shape in pointers:
                binding.bind_input(name, "cpu", 0, np.float32, shape, pointer)
                binding.bind_output(self._shared[name], "cpu", 0, np.float32, shape, pointer)
        for name, value in small.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(value))
        # The small outputs go to arrays of their known shapes, so nothing is fetched back.
        rows = np.shape(feeds["logits_positions"])
        out["next_token_ids"] = np.empty(rows, np.int64)
        if with_logits:
            out["logits"] = np.empty((*rows, self.dims.vocab), np.float32)
        for name in ("next_token_ids", "logits") if with_logits else ("next_token_ids",):
            array = out[name]
            binding.bind_output(name, "cpu", 0, array.dtype, array.shape, array.ctypes.data)
        try:
            self.session.run_with_iobinding(binding)
        except Exception as err:  # onnxruntime's Fail / InvalidArgument
            raise EngineError(f"ONNX Runtime step failed: {str(err).splitlines()[0]}") from None
        with self._bindings_lock:
            self._bindings[key] = binding
            while len(self._bindings) > KEPT_BINDINGS:
                self._bindings.pop(next(iter(self._bindings)))
        return out

    def _run_device(self, feeds: dict, with_logits: bool, cache) -> dict:
        """``run`` with the cache in device memory (ONNX Runtime I/O binding,
        ``bind_input``/``bind_output`` at device addresses): the cache's device copy
        (:class:`~lade_export.backends.cuda.KVMirror`) is brought up to date — the rows
        the latest append kept from this engine's own ``present.*`` outputs copied on the
        device, other writes uploaded — then only ``input_ids``, ``position_ids``,
        ``attention_mask`` and ``logits_positions`` are uploaded; the outputs
        (``next_token_ids``, ``present.*``, ``logits`` when asked) are copied back."""
        from .cuda import grow_buffer, mirror_for

        memory, device = self.device_memory, self._bind_device
        with self._device_lock:
            mirror = mirror_for(self._mirrors, memory, cache, self._past_names)
            mirror.sync(cache, feeds, self._latest)
            self._latest = None
            binding = self.session.io_binding()
            hold = []
            for name in self._past_names:
                binding.bind_input(name, device, 0, np.float32, feeds[name].shape, mirror.address(name))
            for name, value in feeds.items():
                if name in mirror.offsets:
                    continue
                array = np.ascontiguousarray(value)
                buf = grow_buffer(memory, self._device_buffers, name, array.nbytes)
                memory.upload(buf, array)
                hold.append(array)
                binding.bind_input(name, device, 0, array.dtype, array.shape, buf.ptr)
            step = np.shape(feeds["input_ids"])[1]
            rows = np.shape(feeds["logits_positions"])
            shapes = {"next_token_ids": (rows, np.int64)}
            if with_logits:
                shapes["logits"] = ((*rows, self.dims.vocab), np.float32)
            for i in range(self.dims.num_layers):
                for name in (present_key_name(i), present_value_name(i)):
                    shapes[name] = ((1, step, self.dims.kv_heads, self.dims.head_dim), np.float32)
            out, bufs = {}, {}
            for name, (shape, dtype) in shapes.items():
                out[name] = np.empty(shape, dtype)
                bufs[name] = grow_buffer(memory, self._device_buffers, name, out[name].nbytes)
                binding.bind_output(name, device, 0, dtype, shape, bufs[name].ptr)
            memory.synchronize()  # the uploads and moves are queued on another stream than ONNX Runtime's
            try:
                self.session.run_with_iobinding(binding)
            except Exception as err:  # onnxruntime's Fail / InvalidArgument
                raise EngineError(f"ONNX Runtime step failed: {str(err).splitlines()[0]}") from None
            for name, array in out.items():
                memory.download(array, bufs[name])
            memory.synchronize()
            del hold
            self._latest = (out[present_key_name(0)],
                            {"past_key_values." + n[len("present."):]: (bufs[n], 0) for n in out
                             if n.startswith("present.")})
        return out

    def _buffer_address(self, name: str, value) -> int:
        """Address of a cache buffer, checked once per buffer object (the decoder passes the
        same buffers every step; ``ndarray.ctypes`` costs microseconds per call)."""
        known = self._addresses.get(id(value))
        if known is not None and known[0]() is value:
            return known[1]
        if not isinstance(value, np.ndarray) or value.dtype != np.float32 or not value.flags.c_contiguous \
                or not value.flags.writeable:
            raise EngineError(f"{name}: the cache buffer must be a writeable C-contiguous float32 array "
                              f"[batch, kv_heads, capacity, head_dim], got {getattr(value, 'dtype', type(value))} "
                              f"{getattr(value, 'shape', '')}")
        if len(self._addresses) > 4096:  # forget buffers that no longer exist
            self._addresses = {k: v for k, v in self._addresses.items() if v[0]() is not None}
        address = value.ctypes.data
        self._addresses[id(value)] = (weakref.ref(value), address)
        return address

    def close(self) -> None:
        self._bindings.clear()
        self._bound.clear()
        self.session = None
        if self.device_memory is not None:
            with self._device_lock:
                self._mirrors.clear()
                self._device_buffers.clear()
                self._latest = None
                self.device_memory.close()
