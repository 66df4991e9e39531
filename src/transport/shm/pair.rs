//! One pair's move to shared memory as its link opens on demand (`transport::tcp::lazy`).
//!
//! A link opened on demand is dialed by the higher rank of the pair, which writes first; so
//! here the higher rank creates the segment and offers it, and the lower rank's control thread
//! (which accepted the link) maps it and answers without waiting for its engine, so a dial
//! still completes whatever the lower rank is doing. The messages are set-up's
//! ([`super::setup`]), in that direction:
//!
//! 1. higher -> lower: `OFFER` (the segment's path, nonce and size), or `DECLINE` with why it
//!    could not make one (`/dev/shm` full);
//! 2. lower -> higher, after an offer: `ACCEPT` once it has mapped the segment, checked its
//!    header and removed its name, or `REFUSE` with why not.
//!
//! After `ACCEPT` both ranks move the link to a [`ShmTransport`] over the segment, the TCP link
//! kept for wake-ups and liveness; after anything else the pair keeps TCP, with a WARN. The
//! creator removes the name once answered, so a name outlives the exchange only when a process
//! is killed inside it (the next set-up on the host sweeps those).

use super::link::ShmTransport;
use super::segment::Segment;
use super::setup::{
    ACCEPT, Created, DECLINE, MSG_LEN, OFFER, REFUSE, ShmOptions, create_pair, decode_msg, encode_msg,
    map_offer,
};
use crate::error::{Error, Result};
use crate::transport::Transport;

/// A pair segment both ranks map: the link moves onto it once the exchange is done.
#[derive(Debug)]
pub struct Mapped {
    seg: Segment,
    cap: usize,
}

impl Mapped {
    /// The link to the peer over this segment, `wake` (the pair's TCP link) kept for wake-ups
    /// and liveness; `lower`: this rank is the lower of the pair.
    pub fn into_link(self, lower: bool, wake: Box<dyn Transport>) -> Box<dyn Transport> {
        Box::new(ShmTransport::new(self.seg, self.cap, lower, wake))
    }
}

/// The mapped segment, or why the pair keeps TCP.
pub type Outcome = std::result::Result<Mapped, String>;

/// The dialing rank's segment, offered and not yet answered.
#[derive(Debug)]
pub struct Offered {
    seg: Segment,
    cap: usize,
    nonce: u64,
}

/// Step 1, in the dialing (higher) rank: the segment and the `OFFER` naming it, or no segment
/// and a `DECLINE` (no answer comes then) with the reason.
pub fn offer(
    opts: &ShmOptions,
    comm_id: u64,
    rank: usize,
    peer: usize,
) -> (std::result::Result<Offered, String>, [u8; MSG_LEN]) {
    match create_pair(opts, comm_id, rank, peer) {
        Ok(Created { seg, cap, nonce, offer }) => (Ok(Offered { seg, cap, nonce }), offer),
        Err(why) => {
            let msg = encode_msg(DECLINE, 0, 0, &why);
            (Err(why), msg)
        }
    }
}

/// Step 2, in the accepting (lower) rank: the answer to send (none after a `DECLINE`), and the
/// mapped segment or why the pair keeps TCP. An error: the peer broke the exchange.
pub fn answer(
    opts: &ShmOptions,
    peer: usize,
    msg: &[u8; MSG_LEN],
) -> Result<(Option<[u8; MSG_LEN]>, Outcome)> {
    let m = decode_msg(msg)?;
    match m.kind {
        OFFER => Ok(match map_offer(opts, &m) {
            Ok((seg, cap)) => (Some(encode_msg(ACCEPT, m.nonce, 0, "")), Ok(Mapped { seg, cap })),
            Err(why) => {
                (Some(encode_msg(REFUSE, m.nonce, 0, &why)), Err(format!("rank {peer}'s segment: {why}")))
            }
        }),
        DECLINE => Ok((None, Err(format!("rank {peer}: {}", m.text)))),
        k => Err(unexpected(peer, k)),
    }
}

/// Step 2 in an accepting rank that will not map anything (it failed): the `REFUSE` with
/// `why` that answers an `OFFER` (nothing answers a `DECLINE` or a message of another kind).
pub fn refusal(msg: &[u8; MSG_LEN], why: &str) -> Option<[u8; MSG_LEN]> {
    let m = decode_msg(msg).ok()?;
    (m.kind == OFFER).then(|| encode_msg(REFUSE, m.nonce, 0, why))
}

/// The end of step 2, in the dialing rank: the answer to its offer settles the pair (the
/// segment's name is removed either way).
pub fn settle(
    offered: Offered,
    peer: usize,
    msg: &[u8; MSG_LEN],
) -> Result<std::result::Result<Mapped, String>> {
    let Offered { mut seg, cap, nonce } = offered;
    seg.unlink();
    let m = decode_msg(msg)?;
    match m.kind {
        ACCEPT if m.nonce == nonce => Ok(Ok(Mapped { seg, cap })),
        ACCEPT => Err(Error::Remote(
            format!("shared-memory exchange: rank {peer} accepted another offer than this rank's").into(),
        )
        .with_peer(peer)),
        REFUSE => Ok(Err(format!("rank {peer}: {}", m.text))),
        k => Err(unexpected(peer, k)),
    }
}

fn unexpected(peer: usize, kind: u8) -> Error {
    Error::Remote(format!("shared-memory exchange: rank {peer} sent message kind {kind}").into())
        .with_peer(peer)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(dir: &std::path::Path, enabled: bool) -> ShmOptions {
        ShmOptions { enabled, dir: dir.to_path_buf(), ring: 8192, window_region: 0 }
    }

    fn names(dir: &std::path::Path) -> usize {
        std::fs::read_dir(dir).map_or(0, |d| d.count())
    }

    #[test]
    fn an_offer_answered_moves_both_ends_and_leaves_no_name() {
        let dir = tempfile_dir("pair-ok");
        let (offered, msg) = offer(&opts(&dir, true), 7, 3, 1);
        let offered = offered.unwrap();
        assert_eq!(names(&dir), 1);
        let (reply, mapped) = answer(&opts(&dir, true), 3, &msg).unwrap();
        let theirs = settle(offered, 1, &reply.unwrap()).unwrap().unwrap();
        let mine = mapped.unwrap();
        assert_eq!(names(&dir), 0, "both ends removed the name");
        let (a, b) = crate::transport::shm::link::socket_pair_for_tests();
        let mut lo = mine.into_link(true, Box::new(a));
        let mut hi = theirs.into_link(false, Box::new(b));
        assert_eq!(hi.try_write(&[b"over the ring"]).unwrap(), 13);
        let mut got = [0u8; 13];
        assert_eq!(lo.try_read(&mut [&mut got]).unwrap(), 13);
        assert_eq!(&got, b"over the ring");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_disabled_rank_declines_or_refuses_and_the_name_goes() {
        let dir = tempfile_dir("pair-off");
        let (offered, msg) = offer(&opts(&dir, false), 7, 3, 1);
        assert!(offered.unwrap_err().contains("TOROID_SHM_DISABLE"));
        let (reply, mapped) = answer(&opts(&dir, true), 3, &msg).unwrap();
        assert!(reply.is_none(), "no answer to a decline");
        assert!(mapped.unwrap_err().contains("rank 3"));
        let (offered, msg) = offer(&opts(&dir, true), 7, 3, 1);
        let (reply, mapped) = answer(&opts(&dir, false), 3, &msg).unwrap();
        assert!(mapped.is_err());
        let kept = settle(offered.unwrap(), 1, &reply.unwrap()).unwrap();
        assert!(kept.unwrap_err().contains("TOROID_SHM_DISABLE"));
        assert_eq!(names(&dir), 0);
        // A forged offer naming a file outside the directory is refused before anything maps.
        let forged = encode_msg(OFFER, 1, 8192 * 2 + 4096, "/etc/passwd");
        let (reply, mapped) = answer(&opts(&dir, true), 3, &forged).unwrap();
        assert!(reply.is_some() && mapped.unwrap_err().contains("refusing"));
        assert!(answer(&opts(&dir, true), 3, &encode_msg(99, 0, 0, "")).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn tempfile_dir(what: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("toroid-test-{what}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
