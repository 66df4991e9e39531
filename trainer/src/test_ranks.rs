//! Unit-test support: ranks as threads of the test process, joined through an in-memory store.

use std::sync::Arc;
use std::time::Duration;

use toroid::Communicator;
use toroid::rendezvous::MemStore;

/// Runs `body(rank, comm)` on `n` ranks that are threads of this process; returns their results
/// in rank order.
pub(crate) fn on_ranks<T: Send + 'static>(
    n: usize,
    body: impl Fn(usize, Communicator) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let store = Arc::new(MemStore::new());
    let body = Arc::new(body);
    let cfg = toroid::Config { timeout: Duration::from_secs(30), ..toroid::Config::default() };
    let handles: Vec<_> = (0..n)
        .map(|r| {
            let (store, body, cfg) = (store.clone(), body.clone(), cfg.clone());
            std::thread::spawn(move || body(r, Communicator::with_store(r, n, store, &cfg).unwrap()))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}
