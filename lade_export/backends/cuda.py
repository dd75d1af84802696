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

    def upload(self, buf: DeviceBuffer, array: np.ndarray) -> None:
        """Queue a host→device copy of the C-contiguous ``array`` into ``buf`` on the stream;
        keep ``array`` alive until :meth:`synchronize`."""
        if array.nbytes:
            kind = self.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
            self._check(self.cudart.cudaMemcpyAsync(buf.ptr, array.ctypes.data, array.nbytes, kind, self._stream),
                        "cudaMemcpyAsync (host to device)")

    def download(self, array: np.ndarray, buf: DeviceBuffer) -> None:
        """Queue a device→host copy of ``array.nbytes`` bytes of ``buf`` into the C-contiguous
        ``array``; its values are valid after :meth:`synchronize`."""
        if array.nbytes:
            kind = self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
            self._check(self.cudart.cudaMemcpyAsync(array.ctypes.data, buf.ptr, array.nbytes, kind, self._stream),
                        "cudaMemcpyAsync (device to host)")

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
