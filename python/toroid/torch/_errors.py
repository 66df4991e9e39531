"""Errors as torch.distributed raises them: toroid's failures as DistBackendError and its
timeouts (`_torch_error`, the `_torch_errors` decorator), and torch's timeout arguments in
seconds."""

from __future__ import annotations

import datetime
from .. import _lib
from typing import Optional

import torch.distributed as dist


def _seconds(timeout) -> Optional[float]:
    """A Work.wait timeout in seconds; None for none: None, or <= 0 (torch passes
    timedelta(0), its kNoTimeout, when the caller gave none)."""
    if timeout is None:
        return None
    s = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    return s if s > 0 else None


def _opt_timeout(opts) -> Optional[float]:
    """A per-call timeout from torch's options (seconds), or None when unset."""
    return _seconds(getattr(opts, "timeout", None)) if opts is not None else None


_BACKEND_ERROR = getattr(dist, "DistBackendError", RuntimeError)


def _torch_error(e: BaseException, name: str, rank: int, timeout_s: Optional[float]) -> BaseException:
    """A toroid failure as torch reports a backend's: DistBackendError (a RuntimeError, the type
    gloo's failures also are) with gloo's wording first and toroid's detail after it. Refusals
    of the request itself, which leave the group usable (argument errors, a ValueError;
    toroid.UnsupportedError, e.g. AVG on integers), and anything not from toroid pass through
    unchanged."""
    if not isinstance(e, _lib.ToroidError) or isinstance(e, (ValueError, _lib.UnsupportedError)):
        return e
    if isinstance(e, _lib.TimeoutError):
        ms = f"{timeout_s * 1000:.0f}ms" if timeout_s else "the timeout"
        text = f"[Rank {rank}]: Timed out waiting {ms} for {name} to complete. toroid: {e}"
    elif isinstance(e, _lib.RemoteError):
        text = f"[Rank {rank}]: {name} failed: a peer failed (Connection closed by peer, or it aborted). toroid: {e}"
    elif isinstance(e, _lib.AbortedError):
        text = f"[Rank {rank}]: {name} failed: the group was aborted (an earlier operation failed, or abort was called). toroid: {e}"
    else:
        text = f"[Rank {rank}]: {name} failed. toroid: {e}"
    err = _BACKEND_ERROR(text)
    err.__cause__ = e
    return err


def _torch_errors(method):
    """Raises toroid's errors from issuing an operation as torch's (see _torch_error)."""

    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except _lib.ToroidError as e:
            raise _torch_error(e, method.__name__, self.rank(), self._timeout_s) from e

    wrapper.__name__ = method.__name__
    wrapper.__doc__ = method.__doc__
    return wrapper
