//! The store's challenge-response with `TOROID_AUTH_TOKEN`: HMAC-SHA256 keyed by the token.
//!
//! ```text
//! client -> server  hello: magic, version, flags = AUTH, client nonce nc (16 bytes)
//! server -> client  OK, flags = AUTH, server nonce ns (16), server tag = MAC("server", hello, ns)
//! client -> server  client tag = MAC("client", hello, ns)
//! server -> client  OK; requests may follow
//! ```
//!
//! Each side proves it holds the token by a tag over a nonce the other side just drew, so a
//! recorded exchange cannot be replayed (a new connection gets a new nonce), and the token never
//! crosses the wire. The labels differ between the two tags, and from the labels of the rank
//! handshake (`transport::tcp::handshake`), so no tag can be passed off as another. Tags are
//! compared in constant time.
//!
//! With `TOROID_ENCRYPT` the client's plaintext hello asks for TLS (flag `TLS`, no nonce), the
//! server agrees, and the exchange above runs inside TLS with the hello extended by a value
//! both ends export from that handshake ([`BINDING_LABEL`]). The TLS keys are made fresh and
//! never checked against anything else: the tags are what proves that the other end of *this*
//! TLS session holds the token (a machine in the middle would face two sessions with two
//! different exported values). Without it, an observer of the network sees the keys and values
//! (see docs/ENV.md).

use hmac::{KeyInit, Mac};

use crate::config::AuthToken;
use crate::error::{Error, Result};

type HmacSha256 = hmac::Hmac<sha2::Sha256>;

/// Bytes of each side's nonce.
pub(super) const NONCE_LEN: usize = 16;
/// Bytes of an HMAC-SHA256 tag.
pub(super) const TAG_LEN: usize = 32;
/// A nonce.
pub(super) type Nonce = [u8; NONCE_LEN];
/// A tag.
pub(super) type Tag = [u8; TAG_LEN];

/// The exporter label (RFC 8446 section 7.5) of the value the tags cover under TLS.
pub(super) const BINDING_LABEL: &[u8] = b"EXPORTER-toroid-store-binding-v1";
/// Bytes of that value.
pub(super) const BINDING_LEN: usize = 32;

const LABEL_SERVER: &[u8] = b"toroid store v2 server proof";
const LABEL_CLIENT: &[u8] = b"toroid store v2 client proof";

/// A fresh random nonce.
pub(super) fn nonce() -> Result<Nonce> {
    let mut n = [0; NONCE_LEN];
    crate::sys::random::fill(&mut n).map_err(|e| Error::system("store: getrandom", e))?;
    Ok(n)
}

fn mac(token: &AuthToken, label: &[u8], hello: &[u8], server_nonce: &Nonce) -> HmacSha256 {
    // HMAC takes keys of any length, so this cannot fail.
    let mut m =
        <HmacSha256 as KeyInit>::new_from_slice(token.as_bytes()).expect("HMAC accepts any key length");
    m.update(label);
    // The hello has a fixed length for a given flag, so the concatenation is unambiguous.
    m.update(hello);
    m.update(server_nonce);
    m
}

/// The server's proof: a tag over the client's hello (with its nonce) and the server's nonce.
pub(super) fn server_tag(token: &AuthToken, hello: &[u8], server_nonce: &Nonce) -> Tag {
    mac(token, LABEL_SERVER, hello, server_nonce).finalize().into_bytes().into()
}

/// The client's proof: a tag over its hello and the server's nonce.
pub(super) fn client_tag(token: &AuthToken, hello: &[u8], server_nonce: &Nonce) -> Tag {
    mac(token, LABEL_CLIENT, hello, server_nonce).finalize().into_bytes().into()
}

/// Whether `tag` is the server's proof for this exchange (constant time).
pub(super) fn server_tag_ok(token: &AuthToken, hello: &[u8], server_nonce: &Nonce, tag: &[u8]) -> bool {
    mac(token, LABEL_SERVER, hello, server_nonce).verify_slice(tag).is_ok()
}

/// Whether `tag` is the client's proof for this exchange (constant time).
pub(super) fn client_tag_ok(token: &AuthToken, hello: &[u8], server_nonce: &Nonce, tag: &[u8]) -> bool {
    mac(token, LABEL_CLIENT, hello, server_nonce).verify_slice(tag).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_bind_token_label_hello_and_nonce() {
        let t = AuthToken::new(b"s3cret");
        let (h, n) = (b"hello-with-nonce".as_slice(), [3; NONCE_LEN]);
        let s = server_tag(&t, h, &n);
        assert!(server_tag_ok(&t, h, &n, &s));
        // The server's tag never passes as the client's, nor the other way round.
        assert!(!client_tag_ok(&t, h, &n, &s));
        assert!(!server_tag_ok(&t, h, &n, &client_tag(&t, h, &n)));
        assert!(!server_tag_ok(&AuthToken::new(b"other"), h, &n, &s));
        assert!(!server_tag_ok(&t, b"hello-with-nonc3", &n, &s));
        assert!(!server_tag_ok(&t, h, &[4; NONCE_LEN], &s));
        assert!(!server_tag_ok(&t, h, &n, &s[..31]));
        assert_ne!(nonce().unwrap(), nonce().unwrap());
    }
}
