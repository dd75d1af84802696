"""A test double of the TensorRT Python API (10.x and 11.x) and of cuda-bindings' runtime
module, for the part lade-export calls — so CI executes every line of the TensorRT
backend without a GPU. It complements, never replaces, a run on a real GPU.

What it imitates, with the rules that matter enforced the way TensorRT reports them
(a ``False``/``None`` return plus an error in the logger, never an exception):

* ``cuda.bindings.runtime``: ``cudaMalloc``/``cudaFree``/``cudaMemcpyAsync`` on "device"
  memory that is host memory registered by address (copies must go the declared way
  between a device allocation and host memory, within bounds), streams, device
  attributes, ``(cudaError_t, value)`` results.
* builder side (full module only): ``Builder``, ``create_network`` (``STRONGLY_TYPED``;
  always strongly typed on 11), ``OnnxParser.parse_from_file``, builder config (memory
  pool, flags — ``FP16``/``BF16`` exist on 10 only and are refused on a strongly typed
  network — version/hardware compatibility, timing cache, progress monitor) and
  optimization profiles (every network input needs min ≤ opt ≤ max of its rank, fixed
  dims equal to the graph's).
* runtime side (full and lean modules): ``Runtime`` (never without a GPU: real TensorRT
  then returns a broken object that crashes the process), ``deserialize_cuda_engine``
  (lean runtime: version-compatible plans only; full runtime: a version-compatible plan
  needs ``engine_host_code_allowed``; plans of another version or GPU are refused),
  named I/O tensors, per-profile shapes, execution contexts with
  ``set_optimization_profile_async``, ``set_input_shape`` (within the active
  profile's min..max), ``get_tensor_shape`` (outputs resolved from the input shapes),
  ``set_tensor_address`` and ``execute_async_v3`` (every I/O tensor needs a shape and a
  device address large enough).

A "plan" holds the parsed ONNX graph; executing it reads the inputs from fake device
memory, runs the graph with ONNX Runtime and writes the outputs back — so a generation
through the TensorRT backend gives real tokens. The class attributes it defines are
checked against the real lean runtime's API (tests/data/tensorrt_lean_api.json).
"""

from __future__ import annotations

import ctypes
import enum
import importlib.machinery
import json
import sys
import types

import numpy as np

MAGIC = b"TRTDOUBLE1"


# -- the fake GPU and cuda.bindings.runtime -----------------------------------------------

class FakeGpu:
    """Device memory, streams and facts shared by the fake CUDA and TensorRT modules."""

    def __init__(self, capability=(9, 0), devices: int = 1):
        self.capability = capability
        self.devices = devices
        self.memory: dict[int, np.ndarray] = {}
        self.streams: set[int] = set()
        self.freed = 0
        self.bytes_to_host = 0
        self.bytes_to_device = 0
        self.bytes_on_device = 0  # device-to-device copies
        self._mark = 0  # bytes_to_device at the end of the latest execution

    def malloc(self, nbytes: int) -> int:
        arr = np.zeros(max(nbytes, 1), np.uint8)
        ptr = arr.ctypes.data
        self.memory[ptr] = arr
        return ptr

    def region(self, ptr: int, nbytes: int) -> np.ndarray | None:
        """``nbytes`` of device memory from address ``ptr``, which may lie inside an
        allocation as CUDA allows (None: not device memory, or past its allocation's end)."""
        for base, arr in self.memory.items():
            if base <= ptr < base + arr.nbytes or (ptr == base and not nbytes):
                if ptr - base + nbytes > arr.nbytes:
                    return None
                return arr[ptr - base:ptr - base + nbytes]
        return None

    def uploaded_since_last_execution(self) -> int:
        """Host→device bytes copied since the previous execution ended (what a step moves)."""
        return self.bytes_to_device - self._mark


class cudaError_t(enum.IntEnum):  # noqa: N801 - the real name
    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorMemoryAllocation = 2
    cudaErrorInsufficientDriver = 35
    cudaErrorNoDevice = 100
    cudaErrorInvalidDevice = 101
    cudaErrorInvalidResourceHandle = 400


class cudaDeviceAttr(enum.IntEnum):  # noqa: N801
    cudaDevAttrComputeCapabilityMajor = 75
    cudaDevAttrComputeCapabilityMinor = 76


class cudaMemcpyKind(enum.IntEnum):  # noqa: N801
    cudaMemcpyHostToHost = 0
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2
    cudaMemcpyDeviceToDevice = 3
    cudaMemcpyDefault = 4


class cudaStream_t:  # noqa: N801
    def __init__(self, handle: int):
        self.handle = handle

    def __int__(self):
        return self.handle


def _module(name: str, package: bool = False) -> types.ModuleType:
    """An empty module with a spec (importlib.util.find_spec, used by transformers, needs one)."""
    m = types.ModuleType(name)
    m.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        m.__path__ = []
    return m


def make_cudart(gpu: FakeGpu) -> types.ModuleType:
    """A fake ``cuda.bindings.runtime`` over ``gpu``."""
    m = _module("cuda.bindings.runtime")
    ok = cudaError_t.cudaSuccess
    m.cudaError_t, m.cudaDeviceAttr, m.cudaMemcpyKind, m.cudaStream_t = cudaError_t, cudaDeviceAttr, cudaMemcpyKind, \
        cudaStream_t

    def no_driver():
        return gpu.devices is None

    def cudaGetDeviceCount():
        if no_driver():
            return (cudaError_t.cudaErrorInsufficientDriver, None)
        return (ok, gpu.devices)

    def cudaSetDevice(index):
        if no_driver() or not 0 <= index < gpu.devices:
            return (cudaError_t.cudaErrorInvalidDevice,)
        return (ok,)

    def cudaGetErrorName(err):
        return (ok, cudaError_t(err).name.encode())

    def cudaStreamCreate():
        handle = 0x5000 + len(gpu.streams) + 1
        gpu.streams.add(handle)
        return (ok, cudaStream_t(handle))

    def _stream_ok(stream):
        return int(stream) in gpu.streams

    def cudaStreamSynchronize(stream):
        return (ok,) if _stream_ok(stream) else (cudaError_t.cudaErrorInvalidResourceHandle,)

    def cudaStreamDestroy(stream):
        if not _stream_ok(stream):
            return (cudaError_t.cudaErrorInvalidResourceHandle,)
        gpu.streams.discard(int(stream))
        return (ok,)

    def cudaMalloc(size):
        if size > getattr(gpu, "memory_limit", 1 << 34):
            return (cudaError_t.cudaErrorMemoryAllocation, None)
        return (ok, gpu.malloc(size))

    def cudaFree(ptr):
        if ptr not in gpu.memory:
            return (cudaError_t.cudaErrorInvalidValue,)
        del gpu.memory[ptr]
        gpu.freed += 1
        return (ok,)

    def cudaMemcpyAsync(dst, src, count, kind, stream):
        if not _stream_ok(stream):
            return (cudaError_t.cudaErrorInvalidResourceHandle,)
        if kind == cudaMemcpyKind.cudaMemcpyDeviceToDevice:
            if gpu.region(dst, count) is None or gpu.region(src, count) is None:
                return (cudaError_t.cudaErrorInvalidValue,)
            gpu.bytes_on_device += count
            ctypes.memmove(dst, src, count)
            return (ok,)
        if kind == cudaMemcpyKind.cudaMemcpyHostToDevice:
            device, host = dst, src
        elif kind == cudaMemcpyKind.cudaMemcpyDeviceToHost:
            device, host = src, dst
        else:
            return (cudaError_t.cudaErrorInvalidValue,)
        if gpu.region(device, count) is None or gpu.region(host, 0) is not None:
            return (cudaError_t.cudaErrorInvalidValue,)
        if kind == cudaMemcpyKind.cudaMemcpyHostToDevice:
            gpu.bytes_to_device += count
        else:
            gpu.bytes_to_host += count
        ctypes.memmove(dst, src, count)
        return (ok,)

    def cudaDeviceGetAttribute(attr, device):
        if no_driver():
            return (cudaError_t.cudaErrorInsufficientDriver, None)
        major, minor = gpu.capability
        return (ok, major if attr == cudaDeviceAttr.cudaDevAttrComputeCapabilityMajor else minor)

    for f in (cudaGetDeviceCount, cudaSetDevice, cudaGetErrorName, cudaStreamCreate, cudaStreamSynchronize,
              cudaStreamDestroy, cudaMalloc, cudaFree, cudaMemcpyAsync, cudaDeviceGetAttribute):
        setattr(m, f.__name__, f)
    return m


# -- the fake TensorRT ---------------------------------------------------------------------

ONNX_TO_TRT = {1: "FLOAT", 10: "HALF", 16: "BF16", 7: "INT64", 6: "INT32", 9: "BOOL"}
TRT_TO_NUMPY = {"FLOAT": np.float32, "HALF": np.float16, "INT64": np.int64, "INT32": np.int32, "BOOL": np.bool_}


class TrtState:
    """What the fake TensorRT modules share and record: the GPU, the log, the executions."""

    def __init__(self, gpu: FakeGpu, version: str):
        self.gpu = gpu
        self.version = version
        self.major = int(version.split(".")[0])
        self.log: list[str] = []
        self.executions: list[dict] = []
        self.builds: list[dict] = []
        self.deserialized: list[dict] = []

    def error(self, message: str) -> None:
        self.log.append(f"[E] {message}")


def make_tensorrt(state: TrtState, kind: str = "full") -> types.ModuleType:
    """A fake ``tensorrt`` (``kind="full"``: builder, parser and runtime) or
    ``tensorrt_lean`` (``kind="lean"``: runtime only) module of ``state.version``."""
    name = {"full": "tensorrt", "lean": "tensorrt_lean", "dispatch": "tensorrt_dispatch"}[kind]
    m = _module(name)
    m.__version__ = state.version
    major = state.major

    DataType = enum.Enum("DataType", ["FLOAT", "HALF", "BF16", "INT8", "INT32", "INT64", "BOOL", "UINT8"])
    m.DataType = DataType
    m.float32, m.float16, m.bfloat16, m.int8 = DataType.FLOAT, DataType.HALF, DataType.BF16, DataType.INT8
    m.int32, m.int64, m.bool, m.uint8 = DataType.INT32, DataType.INT64, DataType.BOOL, DataType.UINT8
    m.TensorIOMode = enum.Enum("TensorIOMode", ["NONE", "INPUT", "OUTPUT"])
    m.MemoryPoolType = enum.Enum("MemoryPoolType", ["WORKSPACE", "DLA_MANAGED_SRAM", "DLA_LOCAL_DRAM",
                                                    "DLA_GLOBAL_DRAM", "TACTIC_DRAM", "TACTIC_SHARED_MEMORY"])
    flags = ["TF32", "VERSION_COMPATIBLE", "EXCLUDE_LEAN_RUNTIME", "STRICT_NANS", "REFIT", "DEBUG"]
    if major == 10:
        flags += ["FP16", "BF16", "INT8", "OBEY_PRECISION_CONSTRAINTS", "PREFER_PRECISION_CONSTRAINTS"]
    m.BuilderFlag = enum.Enum("BuilderFlag", flags)
    m.HardwareCompatibilityLevel = enum.Enum("HardwareCompatibilityLevel",
                                             ["NONE", "AMPERE_PLUS", "SAME_COMPUTE_CAPABILITY"])

    class Logger:
        INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = range(5)

        def __init__(self, min_severity=1):
            self.min_severity = min_severity

        def log(self, severity, msg):
            state.log.append(msg)

    m.Logger = Logger

    class IProgressMonitor:
        def __init__(self):
            pass

    m.IProgressMonitor = IProgressMonitor
    if kind == "full":
        _add_builder(m, state)
    _add_runtime(m, state, kind)
    return m


class HostMemory(bytes):
    """Stands in for IHostMemory (a buffer: ``memoryview`` and ``bytes`` accept it)."""

    @property
    def nbytes(self):
        return len(self)


def _dims_of(value_info) -> list:
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?")
            for d in value_info.type.tensor_type.shape.dim]


def _add_builder(m, state: TrtState) -> None:
    import onnx

    major = state.major
    m.NetworkDefinitionCreationFlag = enum.IntEnum(
        "NetworkDefinitionCreationFlag", ["EXPLICIT_BATCH", "STRONGLY_TYPED"] if major == 10 else ["STRONGLY_TYPED"],
        start=0)

    class INetworkDefinition:
        def __init__(self, strongly_typed):
            self.strongly_typed = strongly_typed
            self.model = None

        @property
        def num_inputs(self):
            return len(self.model.graph.input) if self.model else 0

    class ParserError:
        def __init__(self, text):
            self.text = text

        def desc(self):
            return self.text

        def __str__(self):
            return self.text

    class OnnxParser:
        def __init__(self, network, logger):
            self.network = network
            self.errors = []

        @property
        def num_errors(self):
            return len(self.errors)

        def get_error(self, index):
            return self.errors[index]

        def parse_from_file(self, path):
            try:
                model = onnx.load(str(path))
                onnx.checker.check_model(model)
            except Exception as err:  # noqa: BLE001 - the parser reports, never raises
                self.errors.append(ParserError(f"ModelImporter.cpp:1: failed to parse {path}: {err}\nmore detail"))
                return False
            self.network.model = model
            return True

    class IOptimizationProfile:
        def __init__(self):
            self.shapes = {}

        def set_shape(self, input, min, opt, max):  # noqa: A002 - TensorRT's names
            self.shapes[input] = (list(min), list(opt), list(max))

        def get_shape(self, input):  # noqa: A002
            return self.shapes.get(input, [])

    class ITimingCache:
        def __init__(self, entries):
            self.entries = entries

        def serialize(self):
            return HostMemory(b"TRTCACHE" + json.dumps(self.entries).encode())

    class IBuilderConfig:
        def __init__(self):
            self.flags = {m.BuilderFlag.TF32}  # TensorRT's default
            self.pools = {}
            self.profiles = []
            self.hardware_compatibility_level = m.HardwareCompatibilityLevel.NONE
            self.progress_monitor = None
            self.cache = None

        def set_memory_pool_limit(self, pool, size):
            self.pools[pool] = size

        def set_flag(self, flag):
            self.flags.add(m.BuilderFlag(flag))

        def clear_flag(self, flag):
            self.flags.discard(m.BuilderFlag(flag))

        def get_flag(self, flag):
            return flag in self.flags

        def add_optimization_profile(self, profile):
            self.profiles.append(profile)
            return len(self.profiles) - 1

        def create_timing_cache(self, serialized):
            data = bytes(serialized)
            if not data:
                return ITimingCache(0)
            if not data.startswith(b"TRTCACHE"):
                state.error("ITimingCache: corrupt timing cache")
                return None
            return ITimingCache(json.loads(data[8:]))

        def set_timing_cache(self, cache, ignore_mismatch):
            if cache is None:
                raise TypeError("set_timing_cache(): incompatible function arguments")
            self.cache = cache
            return True

        def get_timing_cache(self):
            return self.cache

    class Builder:
        def __init__(self, logger):
            if not state.gpu.devices:
                state.error("createInferBuilder: CUDA initialization failure")
            self.logger = logger

        def create_network(self, flags=0):
            strongly = bool(flags & (1 << int(m.NetworkDefinitionCreationFlag.STRONGLY_TYPED))) or major >= 11
            return INetworkDefinition(strongly)

        def create_builder_config(self):
            return IBuilderConfig()

        def create_optimization_profile(self):
            return IOptimizationProfile()

        def build_serialized_network(self, network, config):
            fail = _check_build(network, config)
            if fail:
                state.error(f"IBuilder::buildSerializedNetwork: {fail}")
                return None
            graph = network.model.graph
            inits = {i.name for i in graph.initializer}
            inputs = [{"name": v.name, "dtype": ONNX_TO_TRT[v.type.tensor_type.elem_type], "shape": _dims_of(v)}
                      for v in graph.input if v.name not in inits]
            outputs = [{"name": v.name, "dtype": ONNX_TO_TRT[v.type.tensor_type.elem_type], "shape": _dims_of(v)}
                       for v in graph.output]
            weak = [f.name for f in config.flags if f.name in ("FP16", "BF16")]
            meta = {"version": state.version, "major": major,
                    "version_compatible": m.BuilderFlag.VERSION_COMPATIBLE in config.flags,
                    "hardware_compatibility": config.hardware_compatibility_level.name,
                    "capability": list(state.gpu.capability), "strongly_typed": network.strongly_typed,
                    "precision_flags": weak, "tf32": m.BuilderFlag.TF32 in config.flags,
                    "weight_dtypes": sorted({ONNX_TO_TRT.get(i.data_type) for i in graph.initializer}
                                            & {"FLOAT", "HALF", "BF16"}),  # floating-point weights only
                    "profiles": [{n: p.shapes[n] for n in p.shapes} for p in config.profiles],
                    "inputs": inputs, "outputs": outputs}
            state.builds.append(meta)
            if config.progress_monitor is not None:
                config.progress_monitor.phase_start("Building engine", None, 2)
                for i in range(2):
                    config.progress_monitor.step_complete("Building engine", i + 1)
                config.progress_monitor.phase_finish("Building engine")
            if config.cache is not None:
                config.cache.entries += 1
            head = json.dumps(meta).encode()
            return HostMemory(MAGIC + len(head).to_bytes(8, "little") + head + network.model.SerializeToString())

    def _check_build(network, config):
        if network.model is None:
            return "the network is empty"
        if network.strongly_typed and any(f.name in ("FP16", "BF16") for f in config.flags):
            return "precision flags (FP16/BF16) are not allowed on a strongly typed network"
        inits = {i.name for i in network.model.graph.initializer}
        inputs = [v for v in network.model.graph.input if v.name not in inits]
        dynamic = any(not isinstance(d, int) for v in inputs for d in _dims_of(v))
        if dynamic and not config.profiles:
            return "the network has dynamic inputs but no optimization profile"
        for index, profile in enumerate(config.profiles):
            for v in inputs:
                if v.name not in profile.shapes:
                    return f"optimization profile {index} has no shape for input {v.name}"
                lo, opt, hi = profile.shapes[v.name]
                dims = _dims_of(v)
                if not len(lo) == len(opt) == len(hi) == len(dims):
                    return f"optimization profile {index}: rank of {v.name} is {len(dims)}"
                for d, a, b, c in zip(dims, lo, opt, hi):
                    if not 0 <= a <= b <= c or (isinstance(d, int) and not a == b == c == d):
                        return f"optimization profile {index}: invalid dimensions for {v.name}: {lo} {opt} {hi}"
        return None

    m.Builder, m.OnnxParser = Builder, OnnxParser
    m.INetworkDefinition, m.IBuilderConfig, m.IOptimizationProfile, m.ITimingCache = \
        INetworkDefinition, IBuilderConfig, IOptimizationProfile, ITimingCache


def _add_runtime(m, state: TrtState, kind: str) -> None:
    gpu = state.gpu
    dtype_of = {n: getattr(m.DataType, n) for n in ONNX_TO_TRT.values()}

    class ICudaEngine:
        def __init__(self, meta, onnx_bytes):
            self.meta = meta
            self.onnx_bytes = onnx_bytes
            self.session = None
            self.io = {t["name"]: t for t in meta["inputs"] + meta["outputs"]}
            self.input_names = [t["name"] for t in meta["inputs"]]
            self.output_names = [t["name"] for t in meta["outputs"]]

        @property
        def num_io_tensors(self):
            return len(self.io)

        @property
        def num_optimization_profiles(self):
            return len(self.meta["profiles"])

        def get_tensor_name(self, index):
            return (self.input_names + self.output_names)[index]

        def get_tensor_mode(self, name):
            if name not in self.io:
                return m.TensorIOMode.NONE
            return m.TensorIOMode.INPUT if name in self.input_names else m.TensorIOMode.OUTPUT

        def get_tensor_dtype(self, name):
            return dtype_of[self.io[name]["dtype"]]

        def get_tensor_shape(self, name):
            return tuple(d if isinstance(d, int) else -1 for d in self.io[name]["shape"])

        def get_tensor_profile_shape(self, name, profile_index):
            return [list(s) for s in self.meta["profiles"][profile_index][name]]

        def create_execution_context(self):
            return IExecutionContext(self)

    class IExecutionContext:
        def __init__(self, engine):
            self.engine = engine
            self._profile = 0
            self.shapes = {}
            self.addresses = {}
            self.calls = []

        @property
        def active_optimization_profile(self):
            return self._profile

        def set_optimization_profile_async(self, profile_index, stream_handle):
            self.calls.append(("set_optimization_profile_async", profile_index))
            if not isinstance(stream_handle, int) or stream_handle not in gpu.streams:
                state.error("setOptimizationProfileAsync: invalid stream")
                return False
            if not 0 <= profile_index < self.engine.num_optimization_profiles:
                state.error(f"setOptimizationProfileAsync: profile index {profile_index} out of range")
                return False
            self._profile = profile_index
            self.shapes.clear()
            return True

        def set_input_shape(self, name, shape):
            shape = tuple(int(d) for d in shape)
            self.calls.append(("set_input_shape", name, shape))
            if self.engine.get_tensor_mode(name) != m.TensorIOMode.INPUT:
                state.error(f"setInputShape: {name} is not an input tensor")
                return False
            lo, _, hi = self.engine.meta["profiles"][self._profile][name]
            if len(shape) != len(lo) or any(not a <= d <= b for d, a, b in zip(shape, lo, hi)):
                state.error(f"IExecutionContext::setInputShape: Error Code 3: API Usage Error (Parameter check failed, "
                            f"condition: shape of {name} {list(shape)} within profile {self._profile} min {lo} max {hi})")
                return False
            self.shapes[name] = shape
            return True

        def _symbols(self):
            values = {}
            for name in self.engine.input_names:
                if name in self.shapes:
                    for sym, d in zip(self.engine.io[name]["shape"], self.shapes[name]):
                        if not isinstance(sym, int):
                            values[sym] = d
            return values

        def get_tensor_shape(self, name):
            if name in self.shapes:
                return tuple(self.shapes[name])
            symbols = self._symbols()
            return tuple(d if isinstance(d, int) else symbols.get(d, -1) for d in self.engine.io[name]["shape"])

        def set_tensor_address(self, name, memory):
            self.calls.append(("set_tensor_address", name))
            if name not in self.engine.io:
                state.error(f"setTensorAddress: no tensor {name}")
                return False
            self.addresses[name] = int(memory)
            return True

        def execute_async_v3(self, stream_handle):
            self.calls.append(("execute_async_v3",))
            fail = self._execute(stream_handle)
            if fail:
                state.error(f"IExecutionContext::enqueueV3: {fail}")
                return False
            return True

        def _execute(self, stream_handle):
            eng = self.engine
            if stream_handle not in gpu.streams:
                return "invalid stream"
            missing = [n for n in eng.input_names if n not in self.shapes]
            if missing:
                return f"input shape of {missing[0]} not specified"
            feeds = {}
            for name in eng.input_names + eng.output_names:
                if name not in self.addresses:
                    return f"address of {name} not set"
                shape = self.get_tensor_shape(name)
                dtype = np.dtype(TRT_TO_NUMPY[eng.io[name]["dtype"]])
                nbytes = int(np.prod(shape)) * dtype.itemsize
                region = gpu.region(self.addresses[name], nbytes)
                if region is None:
                    return f"illegal memory access: {name} needs {nbytes} bytes of device memory at its address"
                if name in eng.input_names:
                    feeds[name] = region.view(dtype).reshape(shape).copy()
            state.executions.append({"decode_max_step": eng.meta["profiles"][1]["input_ids"][2][1],
                                     "profile": self._profile, "step": feeds["input_ids"].shape[1],
                                     "past": feeds["past_key_values.0.key"].shape[1],
                                     "n_logits": feeds["logits_positions"].shape[1],
                                     "mask_bytes": feeds["attention_mask"].nbytes,
                                     "bytes_to_device": gpu.uploaded_since_last_execution()})
            gpu._mark = gpu.bytes_to_device
            if getattr(state, "fail_execute", False):
                return "injected failure"
            try:
                if eng.session is None:
                    import onnxruntime as ort

                    eng.session = ort.InferenceSession(eng.onnx_bytes, providers=["CPUExecutionProvider"])
                outs = eng.session.run(eng.output_names, feeds)
            except Exception as err:  # noqa: BLE001 - kernels fail by status, not exceptions
                return f"kernel failure: {str(err).splitlines()[0]}"
            for name, value in zip(eng.output_names, outs):
                if getattr(state, "perturb", None) is not None:  # fault injection: wrong numbers from a kernel
                    value = state.perturb(name, self._profile, value)
                dtype = np.dtype(TRT_TO_NUMPY[eng.io[name]["dtype"]])
                value = np.ascontiguousarray(value, dtype=dtype)
                if value.shape != self.get_tensor_shape(name):
                    return f"output {name} is {value.shape}, not {self.get_tensor_shape(name)}"
                gpu.region(self.addresses[name], value.nbytes)[:] = value.view(np.uint8).reshape(-1)
            return None

    class Runtime:
        def __init__(self, logger):
            if not gpu.devices:
                raise RuntimeError("double: trt.Runtime created without a usable CUDA GPU (real TensorRT returns a "
                                   "broken runtime here and the process crashes)")
            self.logger = logger
            self.engine_host_code_allowed = False

        def deserialize_cuda_engine(self, serialized_engine):
            data = bytes(serialized_engine)
            if not data.startswith(MAGIC):
                state.error("IRuntime::deserializeCudaEngine: Error Code 1: Serialization (magic tag mismatch)")
                return None
            n = int.from_bytes(data[len(MAGIC):len(MAGIC) + 8], "little")
            meta = json.loads(data[len(MAGIC) + 8:len(MAGIC) + 8 + n])
            body = data[len(MAGIC) + 8 + n:]
            fail = self._refuse(meta)
            if fail:
                state.error(f"IRuntime::deserializeCudaEngine: {fail}")
                return None
            state.deserialized.append({"runtime": kind, "decode_max_step": meta["profiles"][1]["input_ids"][2][1]})
            return ICudaEngine(meta, body)

        def _refuse(self, meta):
            vc = meta["version_compatible"]
            if kind != "full" and not vc:
                return "the lean runtime only deserializes version-compatible engines"
            if vc and kind != "lean" and not self.engine_host_code_allowed:
                return "the engine contains host code; set engine_host_code_allowed"
            if (not vc and meta["version"] != state.version) or (vc and meta["major"] > state.major):
                return f"engine built with TensorRT {meta['version']}, this is {state.version}"
            if tuple(meta["capability"]) != tuple(gpu.capability) and meta["hardware_compatibility"] != "AMPERE_PLUS":
                return "engine built for another compute capability"
            return None

    m.Runtime, m.ICudaEngine, m.IExecutionContext = Runtime, ICudaEngine, IExecutionContext


# -- installing the double ----------------------------------------------------------------

ALL_TRT_MODULES = ("tensorrt", "tensorrt_lean", "tensorrt_lean_bindings", "tensorrt_dispatch",
                   "tensorrt_dispatch_bindings")


def install(monkeypatch, version: str | None = "10.16.1.11", kinds=("full",), gpu: FakeGpu | None = None,
            cuda: bool = True) -> TrtState:
    """Put fake TensorRT modules of ``version`` (``kinds``: "full" → ``tensorrt``, "lean" →
    ``tensorrt_lean``) and a fake ``cuda.bindings.runtime`` over ``gpu`` into
    ``sys.modules`` for one test; every other TensorRT module name is made absent.
    ``version=None``: no TensorRT at all; ``cuda=False``: no cuda-bindings."""
    gpu = gpu or FakeGpu()
    state = TrtState(gpu, version or "0.0")
    for name in ALL_TRT_MODULES:
        monkeypatch.setitem(sys.modules, name, None)
    if version is not None:
        for kind in kinds:
            module = make_tensorrt(state, kind)
            monkeypatch.setitem(sys.modules, module.__name__, module)
    if cuda:
        runtime = make_cudart(gpu)
        package, bindings = _module("cuda", package=True), _module("cuda.bindings", package=True)
        package.bindings, bindings.runtime = bindings, runtime
        for name, module in (("cuda", package), ("cuda.bindings", bindings), ("cuda.bindings.runtime", runtime)):
            monkeypatch.setitem(sys.modules, name, module)
    else:
        for name in ("cuda", "cuda.bindings", "cuda.bindings.runtime", "cuda.cudart"):
            monkeypatch.setitem(sys.modules, name, None)
    return state
