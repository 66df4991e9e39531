//! The bytes of the connection handshake: the connector's hello, the acceptor's ack, and with
//! `TOROID_AUTH_TOKEN` their challenge-response MACs (HMAC-SHA256 keyed by the token).
//!
//! A hello or ack is 24 bytes, little-endian: magic `TRDH`, protocol version (u16), kind (u8),
//! flags (u8: bit 0 = authenticates; bits 4-7 = the lane, which of the striped connections
//! between the two ranks this is, 0 for the first or only one), communicator id (u64), sender's
//! rank (u32), receiver's rank (u32). The MACs cover the flags, so a lane cannot be forged.
//! An authenticating hello is followed by the connector's nonce and a MAC over the hello and
//! that nonce; the ack by a MAC over the ack and the connector's nonce.

use hmac::{KeyInit, Mac};

use crate::config::AuthToken;
use crate::error::{Error, Result};

type HmacSha256 = hmac::Hmac<sha2::Sha256>;
/// Bytes of the connector's challenge nonce.
pub(crate) const NONCE_LEN: usize = 16;
/// Bytes of an HMAC-SHA256 tag.
pub(crate) const MAC_LEN: usize = 32;
/// `hello[7]`: the sender authenticates (nonce and MAC follow the hello; a MAC follows the ack).
const FLAG_AUTH: u8 = 1;
/// `hello[7] >> LANE_SHIFT`: the lane (see [`MAX_LANES`]).
const LANE_SHIFT: u8 = 4;
/// Most connections between one pair of ranks (the lane takes the flags' high four bits).
pub use crate::config::MAX_LANES;

/// Wire protocol version; bumped on any incompatible change of handshake or frames.
/// (2: links between ranks of one host start with the shared-memory set-up of `shm`;
/// 3: authenticated handshakes; 4: the frame header carries the fingerprint in its one
/// encoding, `collective::Fingerprint::encode`; 5: striped connections, the hello names its lane;
/// 6: a same-host link opened on demand starts with its own shared-memory exchange, the dialing
/// rank offering, before it is secured.)
pub const PROTOCOL_VERSION: u16 = 6;
const HELLO_MAGIC: u32 = u32::from_le_bytes(*b"TRDH");
pub(crate) const HELLO_LEN: usize = 24;
pub(crate) const KIND_HELLO: u8 = 1;
pub(crate) const KIND_ACK: u8 = 2;

/// A hello or an ack.
pub(crate) type Hello = [u8; HELLO_LEN];
/// The connector's challenge.
pub(crate) type Nonce = [u8; NONCE_LEN];

/// A hello or ack on lane `lane` (below [`MAX_LANES`]).
pub(crate) fn hello(kind: u8, comm_id: u64, from: usize, to: usize, auth: bool, lane: usize) -> Hello {
    debug_assert!(lane < MAX_LANES);
    let mut h = [0u8; HELLO_LEN];
    h[0..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
    h[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    h[6] = kind;
    h[7] = if auth { FLAG_AUTH } else { 0 } | ((lane % MAX_LANES) as u8) << LANE_SHIFT;
    h[8..16].copy_from_slice(&comm_id.to_le_bytes());
    h[16..20].copy_from_slice(&(from as u32).to_le_bytes());
    h[20..24].copy_from_slice(&(to as u32).to_le_bytes());
    h
}

/// The lane `h` names.
pub(crate) fn lane_of(h: &Hello) -> usize {
    (h[7] >> LANE_SHIFT) as usize
}

/// Whether the sender of `h` announced authentication.
pub(crate) fn announces_auth(h: &Hello) -> bool {
    h[7] & FLAG_AUTH != 0
}

/// What rank `from` sends after connecting to rank `to` on `lane`: the hello, then with a token
/// a fresh nonce and the MAC. Returns the message and the nonce (zeros without a token), which the
/// ack must answer.
pub(crate) fn hello_message(
    comm_id: u64,
    from: usize,
    to: usize,
    auth: Option<&AuthToken>,
    lane: usize,
) -> Result<(Vec<u8>, Nonce)> {
    let h = hello(KIND_HELLO, comm_id, from, to, auth.is_some(), lane);
    let mut msg = h.to_vec();
    let mut n = [0; NONCE_LEN];
    if let Some(t) = auth {
        crate::sys::random::fill(&mut n).map_err(|e| Error::system("getrandom", e))?;
        msg.extend_from_slice(&n);
        msg.extend_from_slice(&mac(t, b"toroid hello", &[&h, &n]).finalize().into_bytes());
    }
    Ok((msg, n))
}

/// What rank `from` answers to the checked hello of rank `to`; `extra` is what followed that
/// hello (its nonce first) when a token is set. The ack names the hello's `lane`.
pub(crate) fn ack_message(
    comm_id: u64,
    from: usize,
    to: usize,
    auth: Option<&AuthToken>,
    extra: &[u8],
    lane: usize,
) -> Vec<u8> {
    let ack = hello(KIND_ACK, comm_id, from, to, auth.is_some(), lane);
    let mut msg = ack.to_vec();
    if let Some(t) = auth {
        let n = &extra[..NONCE_LEN];
        msg.extend_from_slice(&mac(t, b"toroid ack", &[&ack, n]).finalize().into_bytes());
    }
    msg
}

/// Checks a hello or ack; returns the sender's rank.
pub(crate) fn check_hello(h: &Hello, kind: u8, comm_id: u64, me: usize, size: usize) -> Result<usize> {
    let u32_at = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
    if u32_at(0) != HELLO_MAGIC {
        return Err(Error::Remote("handshake: not a toroid peer (bad magic)".into()));
    }
    let version = u16::from_le_bytes([h[4], h[5]]);
    if version != PROTOCOL_VERSION {
        return Err(Error::Remote(format!(
            "handshake: peer speaks protocol version {version}, this build speaks {PROTOCOL_VERSION} (mixed toroid versions?)"
        ).into()));
    }
    if h[6] != kind {
        return Err(Error::Remote(format!("handshake: expected message kind {kind}, got {}", h[6]).into()));
    }
    let mut idb = [0u8; 8];
    idb.copy_from_slice(&h[8..16]);
    let id = u64::from_le_bytes(idb);
    if id != comm_id {
        return Err(Error::Remote(
            format!(
                "handshake: peer belongs to communicator {id:#x}, not {comm_id:#x} (a stale or foreign job?)"
            )
            .into(),
        ));
    }
    let (from, to) = (u32_at(16) as usize, u32_at(20) as usize);
    if to != me || from >= size || from == me {
        return Err(Error::Remote(
            format!("handshake: peer claims rank {from} calling rank {to}; this is rank {me} of {size}")
                .into(),
        ));
    }
    Ok(from)
}

/// HMAC-SHA256 of `parts` under `token`, labelled so a hello's tag can never pass as an ack's.
pub(crate) fn mac(token: &AuthToken, label: &[u8], parts: &[&[u8]]) -> HmacSha256 {
    // HMAC takes keys of any length, so this cannot fail.
    let mut m =
        <HmacSha256 as KeyInit>::new_from_slice(token.as_bytes()).expect("HMAC accepts any key length");
    m.update(label);
    for p in parts {
        m.update(p);
    }
    m
}

/// The accepting side's check of a connector's authentication (`extra`: what followed the
/// hello when it announced authentication).
pub(crate) fn check_hello_auth(h: &Hello, extra: Option<&[u8]>, auth: Option<&AuthToken>) -> Result<()> {
    match (auth, extra) {
        (None, None) => Ok(()),
        (Some(_), None) => Err(Error::Remote(
            "handshake: peer did not authenticate (TOROID_AUTH_TOKEN is set here, not there)".into(),
        )),
        (None, Some(_)) => {
            Err(Error::Remote("handshake: peer authenticates but TOROID_AUTH_TOKEN is not set here".into()))
        }
        (Some(t), Some(x)) => {
            // A nonce and a MAC, exactly: anything else cannot be genuine (and must not panic).
            if x.len() != NONCE_LEN + MAC_LEN {
                return Err(Error::Remote("handshake: malformed authentication".into()));
            }
            let (n, tag) = x.split_at(NONCE_LEN);
            mac(t, b"toroid hello", &[h, n]).verify_slice(tag).map_err(|_| {
                Error::Remote("handshake: authentication failed (a different TOROID_AUTH_TOKEN)".into())
            })
        }
    }
}

/// The connecting side's check of an ack `h` and the `tag` that followed it, against the
/// `nonce` its hello sent.
pub(crate) fn ack_is_authentic(h: &Hello, tag: &[u8], nonce: &Nonce, token: &AuthToken) -> bool {
    announces_auth(h) && mac(token, b"toroid ack", &[h, nonce]).verify_slice(tag).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handshake_rejects_foreign_and_stale_peers() {
        let h = hello(KIND_HELLO, 7, 3, 1, false, 0);
        assert_eq!(check_hello(&h, KIND_HELLO, 7, 1, 4).unwrap(), 3);
        assert!(check_hello(&h, KIND_HELLO, 8, 1, 4).unwrap_err().to_string().contains("communicator"));
        assert!(check_hello(&h, KIND_HELLO, 7, 2, 4).is_err());
        assert!(check_hello(&h, KIND_ACK, 7, 1, 4).is_err());
        let mut bad = h;
        bad[4] = 9;
        assert!(check_hello(&bad, KIND_HELLO, 7, 1, 4).unwrap_err().to_string().contains("version"));
        bad[0] = 0;
        assert!(check_hello(&bad, KIND_HELLO, 7, 1, 4).unwrap_err().to_string().contains("magic"));
    }

    #[test]
    fn an_ack_answers_only_the_nonce_and_token_of_its_hello() {
        let t = AuthToken::new(b"s3cret");
        let (msg, nonce) = hello_message(7, 3, 1, Some(&t), 5).unwrap();
        assert_eq!(msg.len(), HELLO_LEN + NONCE_LEN + MAC_LEN);
        let mut h = [0u8; HELLO_LEN];
        h.copy_from_slice(&msg[..HELLO_LEN]);
        assert!(announces_auth(&h));
        assert_eq!(lane_of(&h), 5);
        check_hello_auth(&h, Some(&msg[HELLO_LEN..]), Some(&t)).unwrap();
        let ack = ack_message(7, 1, 3, Some(&t), &msg[HELLO_LEN..], 5);
        let (a, tag) = ack.split_at(HELLO_LEN);
        let a: Hello = a.try_into().unwrap();
        assert_eq!((check_hello(&a, KIND_ACK, 7, 3, 4).unwrap(), lane_of(&a)), (1, 5));
        // The MAC covers the lane: an ack moved to another lane fails.
        let mut moved = a;
        moved[7] = (moved[7] & 0x0f) | (6 << LANE_SHIFT);
        assert!(!ack_is_authentic(&moved, tag, &nonce, &t));
        assert!(ack_is_authentic(&a, tag, &nonce, &t));
        assert!(!ack_is_authentic(&a, tag, &[0; NONCE_LEN], &t));
        assert!(!ack_is_authentic(&a, tag, &nonce, &AuthToken::new(b"other")));
        // Without a token: bare hello and ack, no nonce.
        let (msg, nonce) = hello_message(7, 3, 1, None, 0).unwrap();
        assert_eq!((msg.len(), nonce), (HELLO_LEN, [0; NONCE_LEN]));
        assert_eq!(ack_message(7, 1, 3, None, &[], 0).len(), HELLO_LEN);
    }
}
