"""`TorchStore`: torch's c10d Store as the key-value store toroid meets its ranks through
(toroid_comm_init_with_store's callbacks, see toroid.comm.Store)."""

from __future__ import annotations

import datetime
from typing import Optional

import torch.distributed as dist


def _is_store_timeout(e: BaseException) -> bool:
    """Whether a torch store's exception is its timeout (the key is still missing), as opposed
    to a failure of the store. torch raises DistStoreError "wait timeout after 500ms, keys: ..."
    (TCPStore) or "Wait timeout" (HashStore; FileStore as a plain RuntimeError); a lost or dead
    server is a DistNetworkError ("Broken pipe", "Failed to recv, got 0 bytes", "Socket
    Timeout"), which is never a missing key."""
    network = getattr(dist, "DistNetworkError", None)
    if network is not None and isinstance(e, network):
        return False
    if not isinstance(e, RuntimeError):
        return False
    text = str(e).lower()
    return "timeout" in text or "timed out" in text


class TorchStore:
    """A torch.distributed Store as toroid's caller-supplied store (Comm.with_store): get
    returns None only when torch's store times out; any other failure is raised (and fails
    the communicator's set-up with that exception)."""

    def __init__(self, store: dist.Store):
        self.store = store

    def set(self, key: str, value: bytes) -> None:
        self.store.set(key, value)

    def get(self, key: str, timeout: float) -> Optional[bytes]:
        if timeout <= 0:
            if not self.store.check([key]):
                return None
        else:
            try:
                self.store.wait([key], datetime.timedelta(seconds=timeout))
            except RuntimeError as e:
                if _is_store_timeout(e):
                    return None  # still missing at the deadline
                raise
        return bytes(self.store.get(key))
