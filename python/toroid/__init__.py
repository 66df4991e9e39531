"""toroid for Python: a ctypes binding of the C ABI (include/toroid.h).

    import numpy as np, toroid
    comm = toroid.Comm.from_env()            # under toroid-run / torchrun / srun / mpirun
    x = np.full(4, comm.rank, np.float32)
    comm.all_reduce(x)                       # in place: every rank holds the sum

The library is libtoroid.so from $TOROID_LIBRARY, else the one inside this package (an installed
package has it), else from the cargo target directory of the checkout this package lives in
(target/release or target/debug, the newer one), else from the system library path. An installed
package is the torch.distributed backend "toroid" without an import (torch's entry point
``torch.distributed.backends``); ``import toroid.torch`` registers it too.
"""

from ._lib import (
    AbortedError,
    DataType,
    InvalidArgumentError,
    InvalidUsageError,
    ReduceOp,
    RemoteError,
    Result,
    SPLIT_NOCOLOR,
    TimeoutError,
    ToroidError,
    UnsupportedError,
    error_string,
    library_path,
    version,
)
from .comm import Comm, GrowOffer, Pending, Request, Store, Work, numpy_dtype

__all__ = [
    "AbortedError",
    "Comm",
    "GrowOffer",
    "DataType",
    "InvalidArgumentError",
    "InvalidUsageError",
    "Pending",
    "Request",
    "ReduceOp",
    "RemoteError",
    "Result",
    "SPLIT_NOCOLOR",
    "Store",
    "TimeoutError",
    "ToroidError",
    "UnsupportedError",
    "Work",
    "error_string",
    "library_path",
    "numpy_dtype",
    "version",
]
