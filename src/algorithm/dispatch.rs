//! From an operation to the algorithm that runs it: the one place that maps an [`OpKind`] and
//! a chosen [`Algorithm`] to an algorithm function. A new algorithm is added here, in its own
//! file beside this one, and in `tuning.rs` (its cost and when to choose it).

use super::ring::{self, Phase};
use super::{Group, OpContext, Scratch};
use crate::collective::{Algorithm, Bufs, OpKind};
use crate::dtype::{DataType, ReduceOp};
use crate::error::{Error, Result};
use crate::topology::Layout;
use crate::trace::Phase as Stage;
use crate::transport::exchange::Splits;

/// One validated operation, with its buffers as slices.
#[derive(Debug)]
pub struct Call<'a> {
    /// What to do.
    pub kind: OpKind,
    /// Element type.
    pub dtype: DataType,
    /// The algorithm chosen for it (by the cost model, `TOROID_ALGO` or the caller).
    pub algo: Algorithm,
    /// Input and output (`None` for a barrier, a send, and a non-root's reduce without output).
    pub bufs: Option<Bufs<'a>>,
    /// The input alone (a send; a non-root's reduce without output).
    pub input: Option<&'a [u8]>,
    /// A compressed all-reduce's wire type (`torus2d` only: the communicator runs the others
    /// as an all-to-all and an all-gather, `comm/compressed.rs`).
    pub narrow_to: Option<DataType>,
    /// Chunks the torus is pipelined in (1: not pipelined; the same on every rank).
    pub torus_chunks: usize,
    /// An all-to-all-v's blocks.
    pub splits: Option<Splits<'a>>,
}

/// Runs `call` over `ctx` (the probe is not an algorithm: the communicator runs it).
pub fn run(ctx: &mut OpContext<'_>, scratch: &mut Scratch, layout: &Layout, call: Call<'_>) -> Result<()> {
    let n = ctx.size();
    let me = ctx.rank();
    let Call { kind, dtype, algo, bufs, input, narrow_to, torus_chunks, splits } = call;
    let need = || Error::Internal(format!("{kind:?} without the buffers it needs").into());
    // The phase an algorithm runs in unless it names its own (the ring phases do).
    ctx.phase(match kind {
        _ if algo == Algorithm::ShmDirect => Stage::Window,
        OpKind::AllReduce(_) => Stage::AllReduce,
        OpKind::ReduceScatter(_) => Stage::ReduceScatter,
        OpKind::AllGather | OpKind::SplitExchange => Stage::AllGather,
        OpKind::Broadcast(_) => Stage::Broadcast,
        OpKind::Reduce(..) => Stage::Reduce,
        OpKind::AllToAll
        | OpKind::AllToAllV
        | OpKind::Barrier
        | OpKind::Send(_)
        | OpKind::Recv(_)
        | OpKind::SendRecv => Stage::Exchange,
        OpKind::RecvAny => Stage::RecvAny,
        OpKind::Probe => Stage::None,
    });
    if algo == Algorithm::ShmDirect {
        return match kind {
            OpKind::AllReduce(rop) => super::intra::all_reduce(ctx, bufs.ok_or_else(need)?, dtype, rop),
            OpKind::ReduceScatter(rop) => {
                super::intra::reduce_scatter(ctx, bufs.ok_or_else(need)?, dtype, rop)
            }
            OpKind::AllGather | OpKind::SplitExchange => {
                super::intra::all_gather(ctx, bufs.ok_or_else(need)?)
            }
            OpKind::Broadcast(root) => super::intra::broadcast(ctx, bufs.ok_or_else(need)?, root),
            OpKind::Barrier => super::intra::barrier(ctx),
            _ => Err(Error::Internal(format!("shm_direct cannot run {kind:?}").into())),
        };
    }
    match kind {
        OpKind::AllReduce(rop) => {
            let bufs = bufs.ok_or_else(need)?;
            match algo {
                Algorithm::Doubling => super::doubling::all_reduce(ctx, scratch, bufs, dtype, rop),
                Algorithm::HalvingDoubling => super::halving_doubling::all_reduce(ctx, bufs, dtype, rop),
                Algorithm::HierarchicalRing => super::hierarchical::all_reduce(ctx, layout, bufs, dtype, rop),
                Algorithm::Torus2d => super::torus2d::all_reduce(
                    ctx,
                    scratch,
                    layout,
                    bufs,
                    (dtype, rop),
                    narrow_to,
                    torus_chunks,
                ),
                _ => ring::all_reduce(ctx, Phase::new(Group::World(n), me, dtype, rop), bufs, n),
            }
        }
        OpKind::ReduceScatter(rop) => {
            let bufs = bufs.ok_or_else(need)?;
            ring::reduce_scatter(ctx, scratch, Phase::new(Group::World(n), me, dtype, rop), bufs, n)
        }
        OpKind::AllGather | OpKind::SplitExchange => {
            let buf = match bufs.ok_or_else(need)? {
                Bufs::InPlace(b) => b,
                Bufs::OutOfPlace { send, recv } => {
                    let piece = send.len();
                    recv[me * piece..(me + 1) * piece].copy_from_slice(send);
                    recv
                }
            };
            let count = buf.len() / dtype.size();
            let phase = Phase::new(Group::World(n), me, dtype, ReduceOp::Sum);
            ring::all_gather_phase(ctx, phase, count, buf)
        }
        OpKind::Broadcast(root) => super::broadcast::broadcast(ctx, algo, bufs.ok_or_else(need)?, root),
        OpKind::Reduce(rop, root) => {
            let bufs = match (bufs, input) {
                (Some(b), _) => b,
                // A non-root may pass no output at all.
                (None, Some(send)) => Bufs::OutOfPlace { send, recv: &mut [] },
                (None, None) => return Err(need()),
            };
            super::broadcast::reduce(ctx, scratch, algo, bufs, dtype, rop, root)
        }
        OpKind::AllToAll => super::pairwise::all_to_all(ctx, scratch, bufs.ok_or_else(need)?),
        OpKind::AllToAllV => {
            super::pairwise::all_to_all_v(ctx, splits.ok_or_else(need)?, bufs.ok_or_else(need)?)
        }
        OpKind::Barrier => super::pairwise::barrier(ctx),
        OpKind::Send(peer) => super::pairwise::send(ctx, input.ok_or_else(need)?, peer),
        OpKind::Recv(peer) => match bufs.ok_or_else(need)? {
            Bufs::InPlace(b) => super::pairwise::recv(ctx, b, peer),
            Bufs::OutOfPlace { .. } => Err(need()),
        },
        OpKind::Probe => Err(Error::Internal("the probe is run by the communicator".into())),
        OpKind::RecvAny => {
            Err(Error::Internal("the communicator resolves the source of a receive first".into()))
        }
        OpKind::SendRecv => {
            Err(Error::Internal("the communicator runs a batch of sends and receives".into()))
        }
    }
}
