//! One connection's life on the server: its hello and the challenge-response, its buffers and
//! their caps, the requests it drives through the table, parking, expiry and flushing.

use std::io;
use std::time::Instant;

use super::super::auth;
use super::super::protocol::{
    FLAG_AUTH, FLAG_TLS, HANDSHAKE_DEADLINE, Hello, MAX_FRAME, MAX_HELLO_FRAME, MAX_INPUT, MAX_OUTPUT,
    ST_BAD_REQUEST, ST_OK, VERSION, answer, parse_hello,
};
use super::super::requests::{Handled, handle};
use super::{Conn, Ctx, KEEP_CAPACITY, State, Throttle};

impl Conn {
    /// Largest frame accepted in the current state.
    pub(super) fn frame_cap(&self) -> usize {
        match self.state {
            State::New | State::Proving { .. } => MAX_HELLO_FRAME,
            _ => MAX_FRAME,
        }
    }

    /// Whether a complete frame waits that `drive` would take now.
    pub(super) fn has_work(&self) -> bool {
        let active = matches!(self.state, State::New | State::Proving { .. } | State::Open);
        let avail = &self.rbuf[self.rpos..];
        active
            && self.pending.is_none()
            && self.wbuf.len() - self.wpos <= MAX_OUTPUT
            && avail.first_chunk::<4>().is_some_and(|h| {
                let len = u32::from_le_bytes(*h) as usize;
                len > self.frame_cap() || avail.len() >= 4 + len
            })
    }

    /// Whether to read: always when closing (to discard), otherwise while the connection holds
    /// less than a frame and its unsent output is under the cap.
    pub(super) fn wants_input(&self) -> bool {
        match self.state {
            State::Closing => !self.eof,
            State::Dead => false,
            _ => {
                !self.eof
                    && self.rbuf.len() - self.rpos < self.input_cap()
                    && self.wbuf.len() - self.wpos <= MAX_OUTPUT
            }
        }
    }

    pub(super) fn input_cap(&self) -> usize {
        match self.state {
            State::New | State::Proving { .. } => MAX_HELLO_FRAME + 4,
            _ => MAX_INPUT,
        }
    }

    /// Reads what is available, up to the input cap.
    pub(super) fn fill(&mut self) {
        let mut chunk = [0u8; 64 * 1024];
        if self.rpos > 0 {
            self.rbuf.drain(..self.rpos);
            self.rpos = 0;
        }
        loop {
            let room = match self.state {
                State::Closing => chunk.len(),
                State::Dead => return,
                _ => self.input_cap().saturating_sub(self.rbuf.len()).min(chunk.len()),
            };
            if room == 0 {
                return;
            }
            match self.io.read(&mut chunk[..room]) {
                Ok(0) => {
                    self.eof = true;
                    return;
                }
                // Input after a rejected request is read only to be dropped.
                Ok(_) if matches!(self.state, State::Closing) => {}
                Ok(n) => self.rbuf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::debug!(target: "toroid::store", "store client {}: {e}", self.peer);
                    self.state = State::Dead;
                    return;
                }
            }
        }
    }

    pub(super) fn send(&mut self, payload: &[u8]) {
        // Answers are bounded by MAX_FRAME: a value is at most MAX_VALUE.
        self.wbuf.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        self.wbuf.extend_from_slice(payload);
    }

    /// Answers with an error, logs a warning naming the peer, then closes.
    pub(super) fn reject(&mut self, log: &mut Throttle, msg: &str) {
        log.warn(self.peer, &format!("{msg}; closing"));
        self.send(&answer(ST_BAD_REQUEST, msg.as_bytes()));
        self.rbuf = Vec::new();
        self.rpos = 0;
        self.pending = None;
        self.state = State::Closing;
        self.deadline = Some(Instant::now() + HANDSHAKE_DEADLINE);
    }

    /// Answers every complete request it can; returns whether the table changed.
    pub(super) fn drive(&mut self, ctx: &mut Ctx, now: Instant) -> bool {
        let mut mutated = false;
        while matches!(self.state, State::New | State::Proving { .. } | State::Open)
            && self.wbuf.len() - self.wpos <= MAX_OUTPUT
        {
            if let Some(p) = &self.pending {
                match p.answer(&ctx.table, now) {
                    Some(a) => {
                        self.pending = None;
                        self.send(&a);
                        continue;
                    }
                    None => break,
                }
            }
            let avail = &self.rbuf[self.rpos..];
            let Some(head) = avail.first_chunk::<4>() else {
                break;
            };
            let len = u32::from_le_bytes(*head) as usize;
            let cap = self.frame_cap();
            if len > cap {
                self.reject(&mut ctx.log, &format!("frame of {len} bytes exceeds the limit of {cap} bytes"));
                break;
            }
            if avail.len() < 4 + len {
                break;
            }
            let frame = avail[4..4 + len].to_vec();
            self.rpos += 4 + len;
            match &self.state {
                State::New => self.hello(ctx, &frame),
                State::Proving { hello, nonce } => {
                    let ok = ctx.auth.as_ref().is_some_and(|t| auth::client_tag_ok(t, hello, nonce, &frame));
                    if ok {
                        tracing::debug!(target: "toroid::store", "store client {} authenticated", self.peer);
                        self.open();
                    } else {
                        self.reject(&mut ctx.log, "authentication failed (a different TOROID_AUTH_TOKEN?)");
                    }
                }
                _ => match handle(&frame, &mut ctx.table, now) {
                    Ok(Handled::Answer(a, m)) => {
                        mutated |= m;
                        self.send(&a);
                    }
                    Ok(Handled::Park(p)) => self.pending = Some(p),
                    Ok(Handled::Refused(a, why)) => {
                        ctx.log.warn(self.peer, &why);
                        self.send(&a);
                    }
                    Err(msg) => self.send(&answer(ST_BAD_REQUEST, msg.as_bytes())),
                },
            }
        }
        if self.rpos == self.rbuf.len() {
            self.rpos = 0;
            if self.rbuf.capacity() > KEEP_CAPACITY {
                self.rbuf = Vec::new();
            } else {
                self.rbuf.clear();
            }
        }
        mutated
    }

    /// Handles the first frame: the hello, and with a token the server's challenge and proof.
    /// A client that encrypts asks for TLS first; its hello with the token's nonce then comes
    /// inside TLS, and the tags cover the value exported from that handshake too.
    pub(super) fn hello(&mut self, ctx: &mut Ctx, frame: &[u8]) {
        let hello = parse_hello(frame);
        match (&hello, &ctx.tls, self.io.is_tls()) {
            (Hello::Foreign, ..) => {}
            (Hello::Tls, Some(cfg), false) => {
                let cfg = cfg.clone();
                return self.start_tls(ctx, &cfg);
            }
            (Hello::Tls, None, _) => {
                return self.reject(
                    &mut ctx.log,
                    "this client encrypts (TOROID_ENCRYPT) but the store's server does not: set it alike on every rank",
                );
            }
            (_, Some(_), false) => {
                return self.reject(
                    &mut ctx.log,
                    "the store encrypts (TOROID_ENCRYPT on its server) but this client does not: set it alike on every rank",
                );
            }
            (Hello::Tls, Some(_), true) => {
                return self.reject(&mut ctx.log, "bad hello: TLS asked for twice");
            }
            _ => {}
        }
        match (hello, &ctx.auth) {
            (Hello::Foreign | Hello::Tls, _) => {
                self.reject(&mut ctx.log, &format!("bad hello: not a toroid store client of protocol version {VERSION}"))
            }
            (Hello::Plain, None) => {
                self.open();
            }
            (Hello::Plain, Some(_)) => self.reject(
                &mut ctx.log,
                "the store requires authentication: TOROID_AUTH_TOKEN is set on the store's server, not on this client",
            ),
            (Hello::Auth(_), None) => self.reject(
                &mut ctx.log,
                "this client authenticates but the store's server has no TOROID_AUTH_TOKEN set",
            ),
            (Hello::Auth(_), Some(t)) => {
                let mut bound = frame.to_vec();
                if self.io.is_tls() {
                    let Some(b) = self.io.binding() else {
                        return self.reject(&mut ctx.log, "a request before the TLS handshake finished");
                    };
                    bound.extend_from_slice(&b);
                }
                match auth::nonce() {
                    Ok(nonce) => {
                        let tag = auth::server_tag(t, &bound, &nonce);
                        let mut a = vec![ST_OK, FLAG_AUTH];
                        a.extend_from_slice(&nonce);
                        a.extend_from_slice(&tag);
                        self.send(&a);
                        self.state = State::Proving { hello: bound, nonce };
                    }
                    Err(e) => self.reject(&mut ctx.log, &format!("internal error: {e}")),
                }
            }
        }
    }

    /// Agrees to TLS: the answer goes out in plaintext, then the handshake follows (whatever
    /// arrived after the hello is its start).
    fn start_tls(&mut self, ctx: &mut Ctx, cfg: &std::sync::Arc<rustls::ServerConfig>) {
        let body = answer(ST_OK, &[FLAG_TLS]);
        let mut prefix = (body.len() as u32).to_le_bytes().to_vec();
        prefix.extend_from_slice(&body);
        let early = self.rbuf.split_off(self.rpos);
        self.rbuf.clear();
        self.rpos = 0;
        if let Err(e) = self.io.start_tls(cfg, prefix, &early) {
            self.reject(&mut ctx.log, &format!("TLS handshake: {e}"));
        }
    }

    /// The hello (and proof) passed: requests may follow.
    pub(super) fn open(&mut self) {
        self.state = State::Open;
        self.deadline = None;
        self.send(&answer(ST_OK, &[0]));
    }

    /// Drops a connection whose hello or closing took too long.
    pub(super) fn expire(&mut self, log: &mut Throttle, now: Instant) {
        if self.deadline.is_some_and(|d| now >= d) {
            match self.state {
                State::New | State::Proving { .. } => {
                    log.warn(self.peer, &format!("no complete hello within {HANDSHAKE_DEADLINE:?}; closing"))
                }
                _ => {
                    tracing::debug!(target: "toroid::store", "store client {}: closed after rejection", self.peer)
                }
            }
            self.state = State::Dead;
        }
    }

    /// Writes what the socket takes now.
    pub(super) fn flush(&mut self) {
        while self.wpos < self.wbuf.len() && !matches!(self.state, State::Dead) {
            match self.io.write(&self.wbuf[self.wpos..]) {
                Ok(0) => self.state = State::Dead,
                Ok(n) => self.wpos += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::debug!(target: "toroid::store", "store client {}: {e}", self.peer);
                    self.state = State::Dead;
                }
            }
        }
        if let Err(e) = self.io.push() {
            tracing::debug!(target: "toroid::store", "store client {}: {e}", self.peer);
            self.state = State::Dead;
        }
        if self.wpos == self.wbuf.len() {
            self.wpos = 0;
            if self.wbuf.capacity() > KEEP_CAPACITY {
                self.wbuf = Vec::new();
            } else {
                self.wbuf.clear();
            }
        } else if self.wpos > KEEP_CAPACITY {
            self.wbuf.drain(..self.wpos);
            self.wpos = 0;
        }
        if matches!(self.state, State::Closing)
            && self.wbuf.is_empty()
            && !self.io.wants_write()
            && !self.write_shut
        {
            self.write_shut = true;
            self.io.shutdown_write();
        }
    }
}
