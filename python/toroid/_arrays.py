"""numpy arrays as toroid buffers: their toroid data type (`numpy_dtype`) and address.

Both sit on every call's path, so they avoid numpy's slow attributes: `dtype.name` (about
4 us) and `ndarray.ctypes` (about 2 us, an object made per call); a dict keyed by the dtype
object and the address of a ctypes view of the array's buffer cost a tenth of that."""

from __future__ import annotations

import ctypes

from ._lib import DataType

try:  # numpy is optional for the pointer-level API
    import numpy as np
except ImportError:  # pragma: no cover
    np = None


_NP_TYPES = {
    "int8": DataType.INT8,
    "uint8": DataType.UINT8,
    "int32": DataType.INT32,
    "uint32": DataType.UINT32,
    "int64": DataType.INT64,
    "uint64": DataType.UINT64,
    "float16": DataType.FLOAT16,
    "float32": DataType.FLOAT32,
    "float64": DataType.FLOAT64,
}


# The same keyed by numpy's dtype objects (native byte order; equal dtypes hash alike).
_BY_DTYPE = {} if np is None else {np.dtype(name): t for name, t in _NP_TYPES.items()}


def numpy_dtype(array) -> DataType:
    """The toroid type of a numpy array's elements."""
    t = _BY_DTYPE.get(array.dtype)
    if t is not None:
        return t
    try:
        return _NP_TYPES[array.dtype.name]
    except KeyError:
        raise TypeError(f"toroid has no element type for numpy dtype {array.dtype}") from None


def _buffer(array, writable: bool) -> int:
    if np is None or not isinstance(array, np.ndarray):
        raise TypeError(f"expected a numpy array, got {type(array).__name__}")
    if not array.flags.c_contiguous:
        raise ValueError("toroid needs C-contiguous arrays (use np.ascontiguousarray)")
    if writable and not array.flags.writeable:
        raise ValueError("the output array is read-only")
    try:
        # A writable, non-empty, contiguous buffer: its address, without numpy's ctypes object.
        return ctypes.addressof(ctypes.c_char.from_buffer(array))
    except (TypeError, ValueError, BufferError):
        return array.ctypes.data  # read-only or empty
