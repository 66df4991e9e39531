//! Growing a communicator: the C form of [`crate::Communicator::grow_offer`], `grow`,
//! `grow_async`, `join` and `join_async`. The token travels as text (NUL-terminated, at most
//! `TOROID_JOIN_TOKEN_MAX` bytes with the NUL), so a framework can put it in its own store.

use std::ffi::{c_char, c_int};
use std::sync::{Arc, Mutex};

use super::boundary::{
    CommHandle, Handle, Registry, check_out, code, fail, ffi_boundary, lock, non_negative, opt_str,
    with_comm, write_out,
};
use super::pending::hand_out;
use super::types::{
    TOROID_JOIN_TOKEN_MAX, toroid_comm, toroid_config, toroid_grow_offer, toroid_pending, toroid_result,
};
use crate::comm::{GrowOffer, JoinToken};
use crate::config::Config;
use crate::error::{Error, Result};

/// What a `toroid_grow_offer *` stands for: the offer until a grow takes it.
pub(crate) struct OfferHandle {
    offer: Mutex<Option<GrowOffer>>,
    token: JoinToken,
}

static OFFERS: Registry<OfferHandle> = Registry::new();

impl Handle for OfferHandle {
    type C = toroid_grow_offer;
    const NAME: &'static str = "toroid_grow_offer";
    fn registry() -> &'static Registry<Self> {
        &OFFERS
    }
}

/// Every rank of `comm` calls it to admit `added` new ranks (1 to 65536): a collective that
/// returns at once with *out set to this rank's offer. Hand the offer's token
/// (toroid_grow_offer_token) to the new processes, which call toroid_comm_join; then call
/// toroid_comm_grow (or _async) with the offer. Free it with toroid_grow_offer_free.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_comm_grow_offer(
    comm: *mut toroid_comm,
    added: c_int,
    out: *mut *mut toroid_grow_offer,
) -> toroid_result {
    const NAME: &str = "toroid_comm_grow_offer";
    ffi_boundary!(NAME, {
        with_comm(NAME, comm, |h| {
            check_out(out, "out")?;
            let added = non_negative(added, "added")?;
            let offer = h.comm.grow_offer(added)?;
            let token = offer.token().clone();
            let handle = OfferHandle { offer: Mutex::new(Some(offer)), token };
            // SAFETY: `out` is non-NULL (checked) and valid (the caller's promise).
            unsafe { write_out(out, OfferHandle::into_handle(Arc::new(handle))) };
            Ok(())
        })
    })
}

/// Writes the offer's join token to `buf` as NUL-terminated text; `cap` is the room in `buf`
/// (TOROID_JOIN_TOKEN_MAX is always enough; less than the token needs gives
/// TOROID_INVALID_ARGUMENT and writes nothing). The token is the same on every rank of the
/// grow, and stays readable after the grow.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_grow_offer_token(
    offer: *const toroid_grow_offer,
    buf: *mut c_char,
    cap: usize,
) -> toroid_result {
    const NAME: &str = "toroid_grow_offer_token";
    ffi_boundary!(NAME, {
        let r = OfferHandle::get(offer).and_then(|h| {
            check_out(buf, "buf")?;
            let text = h.token.to_string();
            if text.len() + 1 > cap {
                return Err(Error::InvalidArgument(
                    format!("cap {cap} is too small for the token ({} bytes with the NUL)", text.len() + 1)
                        .into(),
                ));
            }
            // SAFETY: `buf` is non-NULL (checked) and holds `cap` bytes (the caller's promise);
            // `text.len() + 1 <= cap`; the source is our own string.
            unsafe {
                std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), text.len());
                *buf.add(text.len()) = 0;
            }
            Ok(())
        });
        code(NAME, None, r)
    })
}

/// Takes the offer out of its handle (a grow uses it once).
fn take(offer: *const toroid_grow_offer) -> Result<GrowOffer> {
    let h = OfferHandle::get(offer)?;
    let taken = lock(&h.offer).take();
    taken.ok_or_else(|| Error::InvalidUsage("this grow offer was already used by a grow".into()))
}

/// This old rank's part of the grow: once every new process has joined, sets *out to the new
/// communicator, in which this rank keeps its rank. Bounded by `comm`'s timeout. Uses `offer`
/// (made on `comm`) once; free it afterwards. `comm` stays as it was.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_comm_grow(
    comm: *mut toroid_comm,
    offer: *mut toroid_grow_offer,
    out: *mut *mut toroid_comm,
) -> toroid_result {
    const NAME: &str = "toroid_comm_grow";
    ffi_boundary!(NAME, {
        with_comm(NAME, comm, |h| {
            check_out(out, "out")?;
            let grown = h.comm.grow(take(offer)?)?;
            // SAFETY: `out` is non-NULL (checked) and valid (the caller's promise).
            unsafe { write_out(out, CommHandle::into_handle(CommHandle::new(grown))) };
            Ok(())
        })
    })
}

/// toroid_comm_grow in the background (see toroid_comm_init_env_async).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_comm_grow_async(
    comm: *mut toroid_comm,
    offer: *mut toroid_grow_offer,
    out: *mut *mut toroid_pending,
) -> toroid_result {
    const NAME: &str = "toroid_comm_grow_async";
    ffi_boundary!(NAME, {
        with_comm(NAME, comm, |h| {
            check_out(out, "out")?;
            let p = h.comm.grow_async(take(offer)?)?;
            // SAFETY: `out` is non-NULL (checked) and valid (the caller's promise).
            unsafe { hand_out(out, p) };
            Ok(())
        })
    })
}

/// Releases `offer` (on rank 0, stopping the grow's store if no grow took it). NULL is a no-op.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_grow_offer_free(offer: *mut toroid_grow_offer) {
    const NAME: &str = "toroid_grow_offer_free";
    ffi_boundary!(NAME, {
        if !offer.is_null()
            && let Err(e) = OfferHandle::remove(offer)
        {
            let _ = fail(NAME, None, &e);
        }
    })
}

/// The token and settings of a join: `token` parsed, `config`'s rank and timeout and interface
/// (its size must be the token's, and its store_addr NULL: the token says where to meet).
///
/// # Safety
/// `token` NULL or NUL-terminated; `config` NULL or a valid `toroid_config`.
unsafe fn join_args(
    token: *const c_char,
    config: *const toroid_config,
) -> Result<(JoinToken, usize, Config)> {
    // SAFETY: the caller's promise, passed on.
    let text =
        unsafe { opt_str(token, "token")? }.ok_or_else(|| Error::InvalidArgument("token is NULL".into()))?;
    if text.len() >= TOROID_JOIN_TOKEN_MAX {
        return Err(Error::InvalidArgument(
            format!("token of {} bytes: not a join token", text.len()).into(),
        ));
    }
    let token: JoinToken = text.parse()?;
    // SAFETY: the caller's promise, passed on.
    let (rank, size, cfg, store) = unsafe { super::init::read_config(config)? };
    if size != token.size() {
        return Err(Error::InvalidArgument(
            format!("config size {size} is not the token's size {}", token.size()).into(),
        ));
    }
    if store.is_some() {
        return Err(Error::InvalidArgument(
            "config store_addr must be NULL for a join (the token says where)".into(),
        ));
    }
    Ok((token, rank, cfg))
}

/// A new process joins the communicator the old ranks are growing: *out is set to the new
/// communicator once every rank is there. `token` is the text of toroid_grow_offer_token;
/// `config` gives the rank to join as (from the old size to the new size, each new process its
/// own), the size (the token's), the timeout and interface (store_addr must be NULL).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_comm_join(
    token: *const c_char,
    config: *const toroid_config,
    out: *mut *mut toroid_comm,
) -> toroid_result {
    const NAME: &str = "toroid_comm_join";
    ffi_boundary!(NAME, {
        let r = check_out(out, "out")
            // SAFETY: the caller's promise, passed on.
            .and_then(|_| unsafe { join_args(token, config) })
            .and_then(|(token, rank, cfg)| crate::Communicator::join(&token, rank, &cfg))
            .map(|comm| {
                // SAFETY: `out` is non-NULL (checked) and valid (the caller's promise).
                unsafe { write_out(out, CommHandle::into_handle(CommHandle::new(comm))) }
            });
        code(NAME, None, r)
    })
}

/// toroid_comm_join in the background (see toroid_comm_init_env_async). `token` and `config`
/// are read before this returns.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn toroid_comm_join_async(
    token: *const c_char,
    config: *const toroid_config,
    out: *mut *mut toroid_pending,
) -> toroid_result {
    const NAME: &str = "toroid_comm_join_async";
    ffi_boundary!(NAME, {
        let r = check_out(out, "out")
            // SAFETY: the caller's promise, passed on.
            .and_then(|_| unsafe { join_args(token, config) })
            .and_then(|(token, rank, cfg)| crate::Communicator::join_async(&token, rank, &cfg))
            .map(|p| {
                // SAFETY: `out` is non-NULL (checked) and valid (the caller's promise).
                unsafe { hand_out(out, p) }
            });
        code(NAME, None, r)
    })
}
