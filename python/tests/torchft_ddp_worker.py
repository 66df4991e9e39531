"""One replica group (of one rank) of a small torchft DDP job on toroid: torchft's train_ddp.py
(torchft's GitHub repository) with a tiny model on random data. test_torchft.py starts two of
them under an in-process lighthouse, SIGKILLs one mid-run and restarts it.

    python3 torchft_ddp_worker.py --replica-id 0 --lighthouse http://host:port --out DIR

The replica hosts its own TCPStore (the replica group's store: torchft's Manager connects to it,
and the other replicas configure their process groups through the quorum's store). Its
process group is toroid.torchft.ProcessGroupToroid; recovery (a restarted replica healing
from a live one) goes over that group too (torchft's PGTransport: the checkpoint's send/recv
on toroid). Each replica initialises its model from its own seed, and each draws its own
batches, so only torchft's synchronisation (step 0, recovery, the gradient all-reduces) can
make the replicas' parameters equal.

Writes one JSON line per step to DIR/replica<id>.<pid>.jsonl (step, participants, whether the
replica was healing, toroid's operation counts), and stops once its committed step reaches the
number in DIR/stop_at (written by the test) or --max-steps; then saves its model, optimizer and
step to DIR/replica<id>.final.pt and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import sys
import time
from datetime import timedelta

HERE = pathlib.Path(__file__).resolve().parent
if os.environ.get("TOROID_TEST_INSTALLED") != "1":  # else the installed package (conftest.py)
    sys.path.insert(0, str(HERE.parent))  # the toroid package of this checkout

import torch  # noqa: E402
from torch import nn, optim  # noqa: E402
from torch.distributed import TCPStore  # noqa: E402
from torchft import DistributedDataParallel, Manager, Optimizer  # noqa: E402
from torchft.checkpointing.pg_transport import PGTransport  # noqa: E402

from toroid.torchft import ProcessGroupToroid  # noqa: E402


class _DistributedDataParallel(DistributedDataParallel):
    """torchft's DistributedDataParallel with its gradient hook fixed for a failed all-reduce.

    torchft 0.2.0's hook waits on the Manager's work and then asserts that the work's future
    chain exists; when the all-reduce fails (a replica died during it), the work's wait()
    reports the error to the Manager and returns False without building that chain, so the
    assertion kills the surviving replica (`assert fut._fut` in torchft/ddp.py). That happens on
    torchft's ProcessGroupGloo as on toroid (--torchft-ddp-as-is shows it). Here the bucket is
    returned as it is instead: the Manager has recorded the error, so the step does not commit."""

    sigkill_at: "int | None" = None  # --sigkill-at-step

    @staticmethod
    def _comm_hook(state, bucket):
        at = _DistributedDataParallel.sigkill_at
        if at is not None and state.current_step() >= at and state.num_participants() == 2:
            # Dies inside a step that both replicas are in, before its all-reduce: the other
            # replica's all-reduce of this step fails (its peer is gone).
            os.kill(os.getpid(), signal.SIGKILL)
        work = state.allreduce(bucket.buffer())
        if not work.wait():
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut
        fut = work.get_future()
        assert fut._fut
        return fut._fut


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replica-id", type=int, required=True)
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-steps", type=int, default=2000)
    ap.add_argument("--step-sleep", type=float, default=0.05, help="seconds between steps (a slow job)")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds: the group's and the Manager's timeout")
    ap.add_argument("--backend", choices=("toroid", "gloo"), default="toroid", help="gloo: torchft's ProcessGroupGloo")
    ap.add_argument("--torchft-ddp-as-is", action="store_true", help="torchft's DistributedDataParallel unfixed")
    ap.add_argument("--sigkill-at-step", type=int, help="SIGKILL itself in the gradient hook of the first step from "
                    "this one that both replicas are in, before its all-reduce")
    a = ap.parse_args()
    if a.torchft_ddp_as_is and a.sigkill_at_step is not None:
        ap.error("--sigkill-at-step works in this file's gradient hook, not with --torchft-ddp-as-is")
    out = pathlib.Path(a.out)
    rid = a.replica_id
    log = open(out / f"replica{rid}.{os.getpid()}.jsonl", "w", buffering=1)
    timeout = timedelta(seconds=a.timeout)

    store = TCPStore(host_name="localhost", port=0, is_master=True, wait_for_workers=False)
    if a.backend == "gloo":
        from torchft import ProcessGroupGloo

        pg = ProcessGroupGloo(timeout=timeout)
    else:
        pg = ProcessGroupToroid(timeout=timeout)
    transport = PGTransport(pg, timeout=timeout, device=torch.device("cpu"))

    torch.manual_seed(1000 + rid + 100 * os.getpid())  # a replica's own initial weights
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    inner = optim.AdamW(model.parameters(), lr=1e-2)

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    def state_dict():
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"toroid_ddp_{rid}",
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=a.lighthouse,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=30),
        connect_timeout=timedelta(seconds=10),
        checkpoint_transport=transport,
    )
    _DistributedDataParallel.sigkill_at = a.sigkill_at_step
    ddp = (DistributedDataParallel if a.torchft_ddp_as_is else _DistributedDataParallel)(manager, model)
    opt = Optimizer(manager, inner)
    criterion = nn.CrossEntropyLoss()
    data = torch.Generator().manual_seed(7 + 31 * rid + os.getpid())  # a replica's own batches

    stop_file = out / "stop_at"
    while True:
        stop_at = int(stop_file.read_text()) if stop_file.exists() else a.max_steps
        if manager.current_step() >= stop_at:
            break
        x = torch.randn(32, 16, generator=data)
        y = torch.randint(4, (32,), generator=data)
        opt.zero_grad()  # starts the quorum (torchft: must be first in a step)
        loss = criterion(ddp(x), y)
        loss.backward()  # the gradient all-reduce, on toroid
        healing = manager._healing
        opt.step()  # commits (steps the optimizer) only if every rank of this replica may
        group = getattr(pg, "toroid_group", None)
        log.write(json.dumps({
            "step": manager.current_step(), "participants": manager.num_participants(), "healing": healing,
            "errored": str(manager.errored()) if manager.errored() else None, "loss": float(loss),
            "group": type(group).__name__ if group is not None else None,
            "group_size": group.size() if group is not None else None,
            "toroid_ops": dict(group.stats) if group is not None else {}, "t": time.time(),
        }) + "\n")
        time.sleep(a.step_sleep)

    torch.save({"step": manager.current_step(), "model": model.state_dict(), "optim": inner.state_dict()},
               out / f"replica{rid}.final.pt")
    log.write(json.dumps({"done": manager.current_step()}) + "\n")
    manager.shutdown(wait=False)
    pg.shutdown()
    log.close()
    os._exit(0)  # (torchft's servers and the store keep threads: no slow interpreter teardown)


if __name__ == "__main__":
    sys.exit(main())
