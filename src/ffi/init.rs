//! Creating communicators from C: the environment, a `toroid_config`, or the caller's store.

use std::ffi::{c_int, c_void};
use std::sync::Arc;
use std::time::Duration;

use super::boundary::{non_negative, opt_str};
use super::store::CallbackStore;
use super::types::{toroid_config, toroid_config_v1, toroid_store_ops};
use crate::Communicator;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::rendezvous::Store;
use crate::rendezvous::env::{self, Launch, Launcher, StoreAddr};

fn world(rank: c_int, size: c_int) -> Result<(usize, usize)> {
    let rank = non_negative(rank, "rank")?;
    let size = non_negative(size, "size")?;
    if size == 0 || rank >= size {
        return Err(Error::InvalidArgument(format!("rank {rank} is not in a world of {size}").into()));
    }
    Ok((rank, size))
}

/// Reads a caller's `toroid_config`, of any size at least the first version's.
///
/// # Safety
/// `p` must point to a `toroid_config` (or a later, longer version of it) whose `struct_size`
/// says how many bytes are readable; string fields NULL or NUL-terminated.
pub(crate) unsafe fn from_config(p: *const toroid_config) -> Result<Communicator> {
    // SAFETY: the caller's promise, passed on.
    let (launch, cfg) = unsafe { launch_of(p)? };
    Communicator::from_launch(&launch, &cfg)
}

/// What `from_config` joins: the launch (rank, size, store) and the settings.
///
/// # Safety
/// As [`from_config`].
pub(crate) unsafe fn launch_of(p: *const toroid_config) -> Result<(Launch, Config)> {
    // SAFETY: the caller's promise, passed on.
    let (rank, size, cfg, store_addr) = unsafe { read_config(p)? };
    let store = match store_addr {
        Some(addr) => StoreAddr::parse(&addr)?,
        None => {
            // A Slurm job finds its store host in Slurm's variables.
            let launcher = env::detect(&cfg).map_or(Launcher::Toroid, |l| l.launcher);
            env::store_addr(&cfg, launcher)?
        }
    };
    let launch = Launch { rank, size, local_rank: None, local_size: None, store, launcher: Launcher::Toroid };
    Ok((launch, cfg))
}

/// The rank, size, settings (the global ones with the config's overrides) and store address of
/// a caller's `toroid_config`.
///
/// # Safety
/// As [`from_config`].
pub(super) unsafe fn read_config(p: *const toroid_config) -> Result<(usize, usize, Config, Option<String>)> {
    if p.is_null() {
        return Err(Error::InvalidArgument("config is NULL".into()));
    }
    // SAFETY: every version of the struct starts with struct_size.
    let struct_size = unsafe { p.cast::<usize>().read() };
    check_struct_size(struct_size, std::mem::size_of::<toroid_config_v1>(), "toroid_config")?;
    // SAFETY: struct_size >= v1, so the first-version fields are there (the same layout as the
    // start of `toroid_config`); later fields are read only where struct_size covers them.
    let c = unsafe { p.cast::<toroid_config_v1>().read() };
    let encrypt_end = std::mem::offset_of!(toroid_config, encrypt) + std::mem::size_of::<c_int>();
    let encrypt = if struct_size >= encrypt_end {
        // SAFETY: the caller's struct holds this field (struct_size covers it).
        unsafe { std::ptr::addr_of!((*p).encrypt).read() }
    } else {
        0
    };
    let (rank, size) = world(c.rank, c.size)?;
    let mut cfg = Config::global()?.clone();
    if c.timeout_ms > 0 {
        // Cut to the documented maximum, as every timeout given through an API is.
        cfg.timeout = Duration::from_millis(c.timeout_ms.unsigned_abs()).min(crate::config::MAX_TIMEOUT);
    }
    // SAFETY: the caller promises NULL or NUL-terminated strings.
    if let Some(ifname) = unsafe { opt_str(c.socket_ifname, "socket_ifname")? } {
        cfg.socket_ifname = Some(ifname);
    }
    match encrypt {
        0 => {}
        1 => cfg.encrypt = true,
        -1 => cfg.encrypt = false,
        v => {
            return Err(Error::InvalidArgument(
                format!("toroid_config.encrypt is {v}: expected 1 (on), -1 (off) or 0 (TOROID_ENCRYPT)")
                    .into(),
            ));
        }
    }
    // SAFETY: as above.
    let store_addr = unsafe { opt_str(c.store_addr, "store_addr")? };
    Ok((rank, size, cfg, store_addr))
}

/// Joins through the caller's store.
///
/// # Safety
/// `ops` must be NULL or point to a `toroid_store_ops` whose callbacks may be called with `ctx`
/// on this thread until this function returns.
pub(crate) unsafe fn with_store(
    rank: c_int,
    size: c_int,
    ops: *const toroid_store_ops,
    ctx: *mut c_void,
) -> Result<Communicator> {
    let (rank, size) = world(rank, size)?;
    // SAFETY: the caller's promise, passed on.
    unsafe { join_store(rank, size, Config::global()?, ops, ctx) }
}

/// Joins through the caller's store with the rank, size, timeout and interface of a
/// `toroid_config` (whose `store_addr` must be NULL: the store is the caller's).
///
/// # Safety
/// `config` as for [`from_config`]; `ops` and `ctx` as for [`with_store`].
pub(crate) unsafe fn with_store_config(
    config: *const toroid_config,
    ops: *const toroid_store_ops,
    ctx: *mut c_void,
) -> Result<Communicator> {
    // SAFETY: the caller's promise, passed on.
    let (rank, size, cfg, store_addr) = unsafe { read_config(config)? };
    if let Some(addr) = store_addr {
        return Err(Error::InvalidArgument(
            format!("config->store_addr is {addr:?}, but the store is the caller's (set it to NULL)").into(),
        ));
    }
    // SAFETY: the caller's promise, passed on.
    unsafe { join_store(rank, size, &cfg, ops, ctx) }
}

/// # Safety
/// As [`with_store`].
unsafe fn join_store(
    rank: usize,
    size: usize,
    cfg: &Config,
    ops: *const toroid_store_ops,
    ctx: *mut c_void,
) -> Result<Communicator> {
    if ops.is_null() {
        return Err(Error::InvalidArgument("store ops is NULL".into()));
    }
    // SAFETY: every version of the struct starts with struct_size.
    let struct_size = unsafe { ops.cast::<usize>().read() };
    check_struct_size(struct_size, std::mem::size_of::<toroid_store_ops>(), "toroid_store_ops")?;
    // SAFETY: struct_size covers the first version.
    let ops = unsafe { ops.read() };
    // SAFETY: the C caller promises its callbacks accept `ctx` for the duration of this call.
    let store = Arc::new(unsafe { CallbackStore::new(&ops, ctx)? });
    let r = Communicator::with_store(rank, size, store.clone() as Arc<dyn Store>, cfg);
    store.close();
    r
}

/// A versioned struct must be at least as large as its first version.
fn check_struct_size(size: usize, v1: usize, name: &str) -> Result<()> {
    if size < v1 {
        return Err(Error::InvalidArgument(
            format!(
                "{name}.struct_size is {size}, less than the {v1} bytes of its first version (set it to \
             sizeof({name}))"
            )
            .into(),
        ));
    }
    Ok(())
}
