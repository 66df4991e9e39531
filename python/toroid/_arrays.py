"""numpy arrays as toroid buffers: their toroid data type (`numpy_dtype`) and address."""

from __future__ import annotations


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


def numpy_dtype(array) -> DataType:
    """The toroid type of a numpy array's elements."""
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
    return array.ctypes.data
