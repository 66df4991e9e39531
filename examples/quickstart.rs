use toroid::{Communicator, ReduceOp};

fn main() -> toroid::Result<()> {
    // Rank, size and store address from TOROID_* / torchrun / Slurm / MPI variables.
    let comm = Communicator::from_env()?;
    let mut grads = vec![comm.rank() as f32; 1 << 20];
    comm.all_reduce(&mut grads, ReduceOp::Avg)?; // in place, blocking

    // Async: the work owns the buffer until it completes, then gives it back.
    let work = comm.all_reduce_async(vec![1.0f64; 4096], ReduceOp::Sum)?;
    let summed = work.wait()?;
    assert!(summed.iter().all(|x| *x == comm.size() as f64));

    // Sub-communicators: even and odd ranks.
    let half = comm.split(Some((comm.rank() % 2) as u32), comm.rank() as i64)?.unwrap();
    half.barrier()?;
    println!("rank {} of {}: average {}", comm.rank(), comm.size(), grads[0]);
    Ok(())
}
