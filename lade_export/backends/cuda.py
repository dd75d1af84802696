"""A small CUDA wrapper for the TensorRT backend: device buffers, one stream, copies.

Built on NVIDIA's ``cuda-bindings`` package (``cuda.bindings.runtime``, the CUDA runtime
API as Python functions that return ``(cudaError_t, value...)`` tuples), so a service
runs TensorRT engines with the lean runtime, numpy and this — no PyTorch. The module
imports ``cuda.bindings`` lazily; :func:`cuda_unavailable_reason` says what is missing.

Memory is plain ``cudaMalloc`` device memory (never managed memory); host arrays are
ordinary numpy arrays, copied with ``cudaMemcpyAsync`` on the wrapper's stream and made
safe to reuse by :meth:`CudaDevice.synchronize`.
"""

from __future__ import annotations

import numpy as np

from ..errors import BackendUnavailableError, EngineError

INSTALL_HINT = "pip install cuda-bindings (NVIDIA's CUDA runtime bindings; match the driver's CUDA major)"
#: Smallest allocation, bytes: an empty tensor (an empty KV cache) still gets a real address.
MIN_ALLOCATION = 256


def _runtime_module():
    """``cuda.bindings.runtime``, or ``cuda.cudart`` of cuda-python < 12.6. Raises ImportError."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        from cuda import cudart as runtime  # older cuda-python layout
    return runtime


def _error_name(cudart, err) -> str:
    try:
        return cudart.cudaGetErrorName(err)[1].decode()
    except Exception:  # noqa: BLE001 - a name lookup must not hide the original error
        return str(err)


def cuda_unavailable_reason() -> str | None:
    """None when ``cuda-bindings`` imports and sees at least one CUDA device, else a
    one-line reason (missing package, no driver, no device)."""
    try:
        cudart = _runtime_module()
    except ImportError:
        return f"the CUDA wrapper is not installed: {INSTALL_HINT}"
    err, count = cudart.cudaGetDeviceCount()
    if int(err) != 0:
        return f"no usable CUDA GPU (cudaGetDeviceCount: {_error_name(cudart, err)})"
    if not count:
        return "no CUDA GPU is visible (cudaGetDeviceCount: 0)"
    return None


class DeviceBuffer:
    """One device allocation: ``ptr`` (int address) and ``nbytes`` (its capacity)."""

    __slots__ = ("ptr", "nbytes")

    def __init__(self, ptr: int, nbytes: int):
        self.ptr = ptr
        self.nbytes = nbytes


class CudaDevice:
    """CUDA device ``index`` with one stream for copies and engine launches.

    Args:
        index: CUDA device ordinal (0: the first GPU).

    Raises:
        BackendUnavailableError: cuda-bindings is missing or no GPU is usable.
    """

    def __init__(self, index: int = 0):
        reason = cuda_unavailable_reason()
        if reason:
            raise BackendUnavailableError(reason)
        self.cudart = _runtime_module()
        self.index = index
        self._check(self.cudart.cudaSetDevice(index), "cudaSetDevice")
        self._stream = self._check(self.cudart.cudaStreamCreate(), "cudaStreamCreate")
        self._buffers: list[DeviceBuffer] = []

    def _check(self, result, what: str):
        """Unpack a cuda-bindings result tuple; raise :class:`EngineError` on an error code."""
        err, *values = result
        if int(err) != 0:
            raise EngineError(f"CUDA {what} failed: {_error_name(self.cudart, err)}")
        return values[0] if len(values) == 1 else tuple(values) or None

    @property
    def stream_handle(self) -> int:
        """The stream as an integer handle (what TensorRT's ``execute_async_v3`` takes)."""
        return int(self._stream)

    @property
    def compute_capability(self) -> str:
        """``"major.minor"`` of this device, e.g. ``"9.0"`` for an H100/H200."""
        attr = self.cudart.cudaDeviceAttr
        major = self._check(self.cudart.cudaDeviceGetAttribute(attr.cudaDevAttrComputeCapabilityMajor, self.index),
                            "cudaDeviceGetAttribute")
        minor = self._check(self.cudart.cudaDeviceGetAttribute(attr.cudaDevAttrComputeCapabilityMinor, self.index),
                            "cudaDeviceGetAttribute")
        return f"{major}.{minor}"

    def allocate(self, nbytes: int) -> DeviceBuffer:
        """A new device buffer of at least ``nbytes`` (at least :data:`MIN_ALLOCATION`)."""
        size = max(int(nbytes), MIN_ALLOCATION)
        ptr = self._check(self.cudart.cudaMalloc(size), f"cudaMalloc of {size:,} bytes")
        buf = DeviceBuffer(int(ptr), size)
        self._buffers.append(buf)
        return buf

    def free(self, buf: DeviceBuffer) -> None:
        """Release ``buf`` (it must come from :meth:`allocate`)."""
        self._buffers.remove(buf)
        self._check(self.cudart.cudaFree(buf.ptr), "cudaFree")

    def upload(self, buf: DeviceBuffer, array: np.ndarray, offset: int = 0) -> None:
        """Queue a host→device copy of the C-contiguous ``array`` into ``buf`` at byte
        ``offset`` on the stream; keep ``array`` alive until :meth:`synchronize`."""
        if array.nbytes:
            kind = self.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
            self._check(self.cudart.cudaMemcpyAsync(buf.ptr + offset, array.ctypes.data, array.nbytes, kind,
                                                    self._stream), "cudaMemcpyAsync (host to device)")

    def download(self, array: np.ndarray, buf: DeviceBuffer, offset: int = 0) -> None:
        """Queue a device→host copy of ``array.nbytes`` bytes of ``buf`` from byte ``offset``
        into the C-contiguous ``array``; its values are valid after :meth:`synchronize`."""
        if array.nbytes:
            kind = self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
            self._check(self.cudart.cudaMemcpyAsync(array.ctypes.data, buf.ptr + offset, array.nbytes, kind,
                                                    self._stream), "cudaMemcpyAsync (device to host)")

    def copy(self, dst: DeviceBuffer, dst_offset: int, src: DeviceBuffer, src_offset: int, nbytes: int) -> None:
        """Queue a device→device copy of ``nbytes`` bytes (byte offsets into both buffers)."""
        if nbytes:
            kind = self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice
            self._check(self.cudart.cudaMemcpyAsync(dst.ptr + dst_offset, src.ptr + src_offset, nbytes, kind,
                                                    self._stream), "cudaMemcpyAsync (device to device)")

    def synchronize(self) -> None:
        """Wait until every copy and launch queued on the stream has finished."""
        self._check(self.cudart.cudaStreamSynchronize(self._stream), "cudaStreamSynchronize")

    def close(self) -> None:
        """Free every buffer and the stream (idempotent)."""
        if self._stream is None:
            return
        for buf in list(self._buffers):
            self.free(buf)
        self._check(self.cudart.cudaStreamDestroy(self._stream), "cudaStreamDestroy")
        self._stream = None


class HostMemory:
    """The interface of :class:`CudaDevice` (allocate, free, upload, download, copy,
    synchronize) over ordinary host memory, counting the bytes each way like a device
    would move them: what ONNX Runtime's CPU provider binds when the I/O-binding code of
    the CUDA provider runs on ``device="cpu"`` (tests, and the byte accounting).

    Attributes:
        bytes_uploaded: bytes copied by :meth:`upload` (host → "device") so far.
        bytes_downloaded: bytes copied by :meth:`download`.
        bytes_copied: bytes copied by :meth:`copy` ("device" → "device").
    """

    def __init__(self):
        self._arrays: dict[int, np.ndarray] = {}
        self.bytes_uploaded = self.bytes_downloaded = self.bytes_copied = 0

    def allocate(self, nbytes: int) -> DeviceBuffer:
        size = max(int(nbytes), MIN_ALLOCATION)
        array = np.zeros(size, np.uint8)
        self._arrays[array.ctypes.data] = array
        return DeviceBuffer(array.ctypes.data, size)

    def free(self, buf: DeviceBuffer) -> None:
        self._arrays.pop(buf.ptr, None)

    def _view(self, buf: DeviceBuffer, offset: int, nbytes: int) -> np.ndarray:
        array = self._arrays[buf.ptr]
        if offset < 0 or offset + nbytes > array.nbytes:
            raise EngineError(f"copy of {nbytes} bytes at offset {offset} outside a buffer of {array.nbytes} bytes")
        return array[offset:offset + nbytes]

    def upload(self, buf: DeviceBuffer, array: np.ndarray, offset: int = 0) -> None:
        self._view(buf, offset, array.nbytes)[:] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        self.bytes_uploaded += array.nbytes

    def download(self, array: np.ndarray, buf: DeviceBuffer, offset: int = 0) -> None:
        array.reshape(-1).view(np.uint8)[:] = self._view(buf, offset, array.nbytes)
        self.bytes_downloaded += array.nbytes

    def copy(self, dst: DeviceBuffer, dst_offset: int, src: DeviceBuffer, src_offset: int, nbytes: int) -> None:
        self._view(dst, dst_offset, nbytes)[:] = self._view(src, src_offset, nbytes)
        self.bytes_copied += nbytes

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        self._arrays.clear()


def grow_buffer(memory, buffers: dict, key: str, nbytes: int) -> DeviceBuffer:
    """``buffers[key]``, a device buffer of at least ``nbytes`` bytes from ``memory``
    (:class:`CudaDevice` or :class:`HostMemory`): reused while big enough, else freed and
    replaced by one of ``max(nbytes, 2 × old size)`` bytes (doubling, so a growing context
    reallocates O(log n) times). Contents are not kept across a replacement."""
    buf = buffers.get(key)
    if buf is None or buf.nbytes < nbytes:
        if buf is not None:
            memory.free(buf)
        buf = memory.allocate(max(nbytes, 2 * buf.nbytes) if buf is not None else nbytes)
        buffers[key] = buf
    return buf


def contiguous_runs(rows: np.ndarray) -> list[tuple[int, int, int]]:
    """``[(first source row, first destination row, count)]`` of the rows ``rows[j] → j``:
    one copy per run of consecutive source rows."""
    rows = np.asarray(rows, dtype=np.int64)
    if not len(rows):
        return []
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(rows)]])
    return [(int(rows[a]), int(a), int(b - a)) for a, b in zip(starts, ends)]


class KVMirror:
    """The device copy of one sequence-major :class:`lade_export.kv_cache.KVCache`: every
    ``past_key_values.*`` tensor's rows in one device allocation, kept in step with the
    host cache through its write log (:meth:`KVCache.writes_since`).

    Each step (:meth:`sync`, before the engine runs): rows an append copied from the
    engine's latest outputs are copied on the device from the ``present.*`` buffers those
    outputs came from (the accepted tokens' keys and values, moved into place); rows any
    other write touched are uploaded from the host cache; nothing else moves. So a step's
    host→device traffic for the cache is zero when the cache only grows by the engine's
    own steps, and bounded by the rows written otherwise (a pool's compaction re-uploads
    its live rows once).

    Layout: tensor ``t`` (the order of ``names``) at byte ``t × capacity × row_bytes``,
    row ``r`` of it at ``+ r × row_bytes``, ``row_bytes = kv_heads × head_dim × 4``
    (float32, the graph's [batch=1, past, kv_heads, head_dim] contract,
    :mod:`lade_export.specs`).

    Args:
        memory: a :class:`CudaDevice` or :class:`HostMemory`.
        cache: the host cache mirrored (its ``capacity`` sizes the allocation).
        names: the ``past_key_values.*`` input names, layer by layer.

    Raises:
        EngineError: the device allocation failed.
    """

    def __init__(self, memory, cache, names: list[str]):
        import weakref

        dims = cache.dims
        self.memory = memory
        self.names = list(names)
        self.cache = weakref.ref(cache)
        self.capacity = cache.capacity
        self.row_bytes = dims.kv_heads * dims.head_dim * 4
        self.buffer = memory.allocate(len(self.names) * self.capacity * self.row_bytes)
        self.offsets = {n: t * self.capacity * self.row_bytes for t, n in enumerate(self.names)}
        # The cache's revision the device rows match (None: unknown, every row is uploaded);
        # an empty cache is matched by an empty copy.
        self.revision = cache.revision if cache.length == 0 else None
        self.valid = 0  # leading rows that match the host cache

    def address(self, name: str) -> int:
        """Device address of tensor ``name``'s row 0."""
        return self.buffer.ptr + self.offsets[name]

    def sync(self, cache, feeds: dict, latest=None) -> None:
        """Bring rows ``[0, cache.length)`` of the device copy in line with the host cache.

        Args:
            cache: the mirrored cache.
            feeds: its ``past_key_values.*`` feeds this step (host views, for uploads).
            latest: ``(source, buffers)`` of the engine's latest run — the ``present.0.key``
                array it returned and ``{past name: (device buffer of its present output,
                byte offset)}``; an append that copied from ``source`` is copied on the
                device. None: every changed row is uploaded.
        """
        n = cache.length
        writes = None if self.revision is None else cache.writes_since(self.revision)
        valid = 0 if writes is None else self.valid
        for _rev, start, source, rows, count in writes or ():
            if latest is not None and source is latest[0] and start == valid:
                rows = np.arange(count) if rows is None else rows
                for src_row, dst_row, k in contiguous_runs(rows):
                    for name in self.names:
                        buf, base = latest[1][name]
                        self.memory.copy(self.buffer, self.offsets[name] + (start + dst_row) * self.row_bytes,
                                         buf, base + src_row * self.row_bytes, k * self.row_bytes)
                valid = start + count
            else:
                valid = min(valid, start)
        valid = min(valid, n)
        if valid < n:
            for name in self.names:
                rows = np.ascontiguousarray(feeds[name][0, valid:n])
                self.memory.upload(self.buffer, rows, self.offsets[name] + valid * self.row_bytes)
        self.valid = n
        self.revision = cache.revision

    def close(self) -> None:
        """Free the device allocation (idempotent)."""
        if self.buffer is not None:
            self.memory.free(self.buffer)
            self.buffer = None


def mirror_for(mirrors: dict, memory, cache, names: list[str]) -> KVMirror:
    """The :class:`KVMirror` of ``cache`` in an engine's ``mirrors`` (``id(cache)`` → mirror),
    created on first use and replaced when its id was reused by another cache or the
    ``past_key_values.*`` ``names`` differ; mirrors of caches that no longer exist are
    freed first.

    Raises:
        EngineError: a new mirror's device allocation failed.
    """
    for key in [k for k, m in mirrors.items() if m.cache() is None]:
        mirrors.pop(key).close()
    mirror = mirrors.get(id(cache))
    if mirror is None or mirror.cache() is not cache or mirror.names != list(names):
        if mirror is not None:
            mirror.close()
        mirror = mirrors[id(cache)] = KVMirror(memory, cache, names)
    return mirror
