"""Finding the NVRTC of torch's CUDA wheels, which compiles toroid's GPU kernels."""

from __future__ import annotations

import os
from typing import Optional


def nvrtc_from_torch() -> Optional[str]:
    """The libnvrtc.so.13 of torch's CUDA wheels (nvidia/cu13/lib or nvidia/cuda_nvrtc/lib), if
    installed: the NVRTC that matches torch's CUDA, which the driver supports."""
    try:
        import nvidia  # (a namespace package of torch's CUDA wheels)
    except ImportError:
        return None
    for p in getattr(nvidia, "__path__", []):
        for d in ("cu13", "cuda_nvrtc"):
            f = os.path.join(p, d, "lib", "libnvrtc.so.13")
            if os.path.exists(f):
                return f
    return None
