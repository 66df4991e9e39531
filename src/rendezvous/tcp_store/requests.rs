//! What the server does with an authenticated request: the bounded table of keys, the
//! operations, and GET/WAIT requests parked until their keys arrive or their deadline passes.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::protocol::{
    Dec, ENTRY_OVERHEAD, MAX_KEY, MAX_PARK, MAX_STORED, MAX_VALUE, MAX_WAIT_KEYS, OP_ADD, OP_DELETE, OP_GET,
    OP_SET, OP_WAIT, ST_BAD_REQUEST, ST_INVALID_USAGE, ST_OK, ST_TIMEOUT, answer,
};

/// The keys and values, with the bytes they count for against [`MAX_STORED`].
#[derive(Default)]
pub(crate) struct Table {
    map: HashMap<Vec<u8>, Vec<u8>>,
    bytes: usize,
    /// Keys set or added since the last [`Table::take_changed`]: what parked requests wait on.
    changed: Vec<Vec<u8>>,
}

fn cost(key: &[u8], value: &[u8]) -> usize {
    key.len() + value.len() + ENTRY_OVERHEAD
}

impl Table {
    pub(super) fn get(&self, key: &[u8]) -> Option<&Vec<u8>> {
        self.map.get(key)
    }

    fn contains(&self, key: &[u8]) -> bool {
        self.map.contains_key(key)
    }

    /// Stores `value` under `key` unless the total would pass [`MAX_STORED`].
    fn insert(&mut self, key: &[u8], value: Vec<u8>) -> Result<(), String> {
        let old = self.map.get(key).map_or(0, |v| cost(key, v));
        let new = self.bytes - old + cost(key, &value);
        if new > MAX_STORED {
            return Err(format!(
                "store full: storing {} bytes under a key of {} bytes would pass the limit of {MAX_STORED} bytes",
                value.len(),
                key.len()
            ));
        }
        self.bytes = new;
        self.map.insert(key.to_vec(), value);
        self.changed.push(key.to_vec());
        Ok(())
    }

    /// The keys set or added since the last call (the server wakes the requests parked on
    /// them, and only those).
    pub(super) fn take_changed(&mut self) -> Vec<Vec<u8>> {
        std::mem::take(&mut self.changed)
    }

    fn remove(&mut self, key: &[u8]) -> bool {
        match self.map.remove(key) {
            Some(v) => {
                self.bytes -= cost(key, &v);
                true
            }
            None => false,
        }
    }

    #[cfg(test)]
    pub(super) fn bytes(&self) -> usize {
        self.bytes
    }
}

enum Want {
    Get(Vec<u8>),
    Wait(Vec<Vec<u8>>),
}

/// A GET or WAIT waiting for its keys.
pub(crate) struct Pending {
    want: Want,
    pub(super) deadline: Instant,
    timeout_ms: u64,
}

impl Pending {
    /// The first key it waits for that `table` lacks (`None`: it can be answered now).
    pub(super) fn first_missing<'a>(&'a self, table: &Table) -> Option<&'a [u8]> {
        match &self.want {
            Want::Get(k) => (!table.contains(k)).then_some(k.as_slice()),
            Want::Wait(keys) => keys.iter().find(|k| !table.contains(k)).map(Vec::as_slice),
        }
    }

    /// The answer, once the keys are there or the deadline passed.
    pub(super) fn answer(&self, table: &Table, now: Instant) -> Option<Vec<u8>> {
        match &self.want {
            Want::Get(k) => {
                if let Some(v) = table.get(k) {
                    return Some(answer(ST_OK, v));
                }
            }
            Want::Wait(keys) => {
                if keys.iter().all(|k| table.contains(k)) {
                    return Some(answer(ST_OK, &[]));
                }
            }
        }
        if now >= self.deadline {
            let missing: Vec<_> = match &self.want {
                Want::Get(k) => vec![String::from_utf8_lossy(k)],
                Want::Wait(keys) => keys
                    .iter()
                    .filter(|k| !table.contains(k))
                    .take(8)
                    .map(|k| String::from_utf8_lossy(k))
                    .collect(),
            };
            let msg = format!("waited {} ms for keys {missing:?}", self.timeout_ms);
            return Some(answer(ST_TIMEOUT, msg.as_bytes()));
        }
        None
    }
}

/// What a request comes to.
pub(crate) enum Handled {
    /// The answer, and whether the table changed.
    Answer(Vec<u8>, bool),
    /// A GET or WAIT whose keys are not all there yet.
    Park(Pending),
    /// A request over a limit: the answer (an error), and why, for the log.
    Refused(Vec<u8>, String),
}

fn key<'a>(d: &mut Dec<'a>) -> Result<&'a [u8], String> {
    let k = d.bytes()?;
    if k.len() > MAX_KEY {
        return Err(format!("key of {} bytes exceeds the limit of {MAX_KEY} bytes", k.len()));
    }
    Ok(k)
}

/// Handles one request frame. A malformed one is an `Err` (answered, the connection stays:
/// its frames are still in step).
pub(crate) fn handle(frame: &[u8], table: &mut Table, now: Instant) -> Result<Handled, String> {
    let refuse = |why: String| Ok(Handled::Refused(answer(ST_BAD_REQUEST, why.as_bytes()), why));
    let mut d = Dec(frame);
    let park = |want, timeout_ms: u64| {
        // Cut to MAX_PARK, so that every parked request has a deadline.
        let wait = Duration::from_millis(timeout_ms).min(MAX_PARK);
        Handled::Park(Pending { want, deadline: now + wait, timeout_ms: wait.as_millis() as u64 })
    };
    let out = match d.u8()? {
        OP_SET => {
            let k = match key(&mut d) {
                Ok(k) => k,
                Err(why) => return refuse(why),
            };
            let value = d.bytes()?;
            d.end()?;
            if value.len() > MAX_VALUE {
                return refuse(format!(
                    "value of {} bytes exceeds the limit of {MAX_VALUE} bytes",
                    value.len()
                ));
            }
            if let Err(why) = table.insert(k, value.to_vec()) {
                return refuse(why);
            }
            Handled::Answer(answer(ST_OK, &[]), true)
        }
        OP_GET => {
            let timeout_ms = d.u64()?;
            let k = match key(&mut d) {
                Ok(k) => k,
                Err(why) => return refuse(why),
            };
            d.end()?;
            park(Want::Get(k.to_vec()), timeout_ms)
        }
        OP_ADD => {
            let delta = d.i64()?;
            let k = match key(&mut d) {
                Ok(k) => k,
                Err(why) => return refuse(why),
            };
            d.end()?;
            let name = String::from_utf8_lossy(k);
            let cur = match table.get(k) {
                Some(v) => match crate::rendezvous::parse_counter(&name, v) {
                    Ok(n) => n,
                    Err(e) => {
                        return Ok(Handled::Answer(answer(ST_INVALID_USAGE, e.detail().as_bytes()), false));
                    }
                },
                None => 0,
            };
            let new = cur.wrapping_add(delta);
            if let Err(why) = table.insert(k, new.to_string().into_bytes()) {
                return refuse(why);
            }
            Handled::Answer(answer(ST_OK, &new.to_le_bytes()), true)
        }
        OP_WAIT => {
            let timeout_ms = d.u64()?;
            let n = d.u32()? as usize;
            if n > MAX_WAIT_KEYS {
                return refuse(format!("WAIT on {n} keys exceeds the limit of {MAX_WAIT_KEYS} keys"));
            }
            let mut keys = Vec::with_capacity(n);
            for _ in 0..n {
                match key(&mut d) {
                    Ok(k) => keys.push(k.to_vec()),
                    Err(why) => return refuse(why),
                }
            }
            d.end()?;
            park(Want::Wait(keys), timeout_ms)
        }
        OP_DELETE => {
            let k = match key(&mut d) {
                Ok(k) => k,
                Err(why) => return refuse(why),
            };
            d.end()?;
            Handled::Answer(answer(ST_OK, &[u8::from(table.remove(k))]), false)
        }
        op => return Err(format!("unknown operation {op}")),
    };
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::super::protocol::Enc;
    use super::*;

    fn req(e: Enc) -> Vec<u8> {
        e.finish().unwrap()[4..].to_vec()
    }

    fn set(k: &[u8], v: &[u8]) -> Vec<u8> {
        let mut e = Enc::new(OP_SET);
        e.bytes(k);
        e.bytes(v);
        req(e)
    }

    fn refused(h: Result<Handled, String>) -> String {
        match h {
            Ok(Handled::Refused(a, why)) => {
                assert_eq!(a[0], ST_BAD_REQUEST);
                why
            }
            _ => panic!("not refused"),
        }
    }

    #[test]
    fn keys_values_and_waits_over_their_caps_are_refused() {
        let (mut t, now) = (Table::default(), Instant::now());
        let big_key = vec![b'k'; MAX_KEY + 1];
        assert!(refused(handle(&set(&big_key, b"v"), &mut t, now)).contains("key of 1025 bytes"));
        let mut g = Enc::new(OP_GET);
        g.u64(1);
        g.bytes(&big_key);
        assert!(refused(handle(&req(g), &mut t, now)).contains("limit"));
        let big = vec![0; MAX_VALUE + 1];
        assert!(refused(handle(&set(b"k", &big), &mut t, now)).contains("value of"));
        // A WAIT naming millions of keys is refused from its count, before anything is read.
        let mut w = Enc::new(OP_WAIT);
        w.u64(1);
        w.u32(4_000_000);
        assert!(refused(handle(&req(w), &mut t, now)).contains("4000000 keys"));
        assert_eq!(t.bytes(), 0);
        // At the caps, accepted.
        assert!(matches!(handle(&set(&big_key[1..], &big[1..]), &mut t, now), Ok(Handled::Answer(_, true))));
        assert_eq!(t.bytes(), MAX_KEY + MAX_VALUE + ENTRY_OVERHEAD);
    }

    #[test]
    fn the_total_is_capped_and_freed_by_overwrite_and_delete() {
        let (mut t, now) = (Table::default(), Instant::now());
        let v = vec![1; MAX_VALUE];
        let mut n = 0;
        while let Ok(Handled::Answer(..)) = handle(&set(format!("k{n}").as_bytes(), &v), &mut t, now) {
            n += 1;
        }
        assert_eq!(n, MAX_STORED / (MAX_VALUE + 2 + ENTRY_OVERHEAD));
        assert!(t.bytes() <= MAX_STORED);
        assert!(refused(handle(&set(b"x", &v), &mut t, now)).contains("store full"));
        // Overwriting with less, or deleting, makes room again.
        assert!(matches!(handle(&set(b"k0", b""), &mut t, now), Ok(Handled::Answer(..))));
        assert!(matches!(handle(&set(b"x", &v), &mut t, now), Ok(Handled::Answer(..))));
        let mut d = Enc::new(OP_DELETE);
        d.bytes(b"x");
        assert!(matches!(handle(&req(d), &mut t, now), Ok(Handled::Answer(a, _)) if a == [ST_OK, 1]));
        let mut a = Enc::new(OP_ADD);
        a.i64(5);
        a.bytes(b"c");
        assert!(matches!(handle(&req(a), &mut t, now), Ok(Handled::Answer(..))));
    }

    #[test]
    fn parked_requests_always_have_a_deadline() {
        let (mut t, now) = (Table::default(), Instant::now());
        let mut g = Enc::new(OP_GET);
        g.u64(u64::MAX);
        g.bytes(b"never");
        match handle(&req(g), &mut t, now) {
            Ok(Handled::Park(p)) => {
                assert_eq!(p.deadline, now + MAX_PARK);
                assert!(p.answer(&t, now).is_none());
                assert_eq!(p.answer(&t, now + MAX_PARK).unwrap()[0], ST_TIMEOUT);
            }
            _ => panic!("not parked"),
        }
    }
}
