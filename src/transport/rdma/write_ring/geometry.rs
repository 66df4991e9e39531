//! What the two sides of an RDMA ring agree on before connecting: its [`Geometry`] (slots and
//! slot size) and the [`RingInfo`] each sends the other (queue pair, receive ring, geometry),
//! with the checked encoding of that message.

use super::super::verbs::{QpInfo, RemoteRegion};
use crate::error::{Error, Result};

/// The shape of a ring: `slots` slots of `slot_bytes` bytes each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Slots, a power of two from 1 to 4096.
    pub slots: usize,
    /// Bytes per slot, 1 to 1 GiB.
    pub slot_bytes: usize,
}

impl Geometry {
    /// 16 slots of 64 KiB: 1 MiB per direction, so a 512 KiB frame is 8 writes in flight.
    pub const DEFAULT: Geometry = Geometry { slots: 16, slot_bytes: 64 * 1024 };

    /// Checks the bounds (also those a peer announces).
    pub fn check(&self) -> Result<()> {
        if !self.slots.is_power_of_two()
            || self.slots > 4096
            || self.slot_bytes == 0
            || self.slot_bytes > 1 << 30
        {
            return Err(Error::InvalidArgument(
                format!("RDMA ring of {} slots of {} bytes: slots must be a power of two up to 4096, slots 1 byte to 1 GiB", self.slots, self.slot_bytes).into(),
            ));
        }
        Ok(())
    }

    /// Bytes of one ring.
    pub fn bytes(&self) -> usize {
        self.slots * self.slot_bytes
    }

    /// Send-queue entries the ring may use: a write per slot, a credit write per slot, close.
    pub fn send_depth(&self) -> usize {
        2 * self.slots + 1
    }

    /// Receives it keeps posted: the peer's writes per slot, its credits per slot, its close.
    pub fn recv_depth(&self) -> usize {
        2 * self.slots + 1
    }
}

/// What the peer needs to write into a ring: the queue pair, the receive ring's region, and
/// its geometry. [`RingInfo::LEN`] bytes on the wire (through the store), little-endian.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingInfo {
    /// The queue pair to connect to.
    pub qp: QpInfo,
    /// Where the writes go.
    pub ring: RemoteRegion,
    /// Its shape (both sides use the same).
    pub geometry: Geometry,
}

const INFO_MAGIC: &[u8; 4] = b"TRIB";
const INFO_VERSION: u16 = 1;

impl RingInfo {
    /// Encoded length.
    pub const LEN: usize = 64;

    /// The bytes the peer decodes.
    pub fn encode(&self) -> [u8; RingInfo::LEN] {
        let mut b = [0u8; RingInfo::LEN];
        b[0..4].copy_from_slice(INFO_MAGIC);
        b[4..6].copy_from_slice(&INFO_VERSION.to_le_bytes());
        b[6] = self.qp.mtu;
        b[8..12].copy_from_slice(&self.qp.qpn.to_le_bytes());
        b[12..16].copy_from_slice(&self.qp.psn.to_le_bytes());
        b[16..18].copy_from_slice(&self.qp.lid.to_le_bytes());
        b[20..36].copy_from_slice(&self.qp.gid);
        b[36..44].copy_from_slice(&self.ring.addr.to_le_bytes());
        b[44..52].copy_from_slice(&(self.ring.len as u64).to_le_bytes());
        b[52..56].copy_from_slice(&self.ring.rkey.to_le_bytes());
        b[56..60].copy_from_slice(&(self.geometry.slots as u32).to_le_bytes());
        b[60..64].copy_from_slice(&(self.geometry.slot_bytes as u32).to_le_bytes());
        b
    }

    /// Decodes and checks a peer's bytes: magic, version, a valid geometry, a ring region
    /// exactly that large, a known MTU.
    pub fn decode(b: &[u8]) -> Result<RingInfo> {
        let bad = |what: &str| Error::Remote(format!("bad RDMA ring description: {what}").into());
        if b.len() != RingInfo::LEN {
            return Err(bad(&format!("{} bytes, not {}", b.len(), RingInfo::LEN)));
        }
        if &b[0..4] != INFO_MAGIC {
            return Err(bad("wrong magic"));
        }
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or([0; 8]));
        if u16_at(4) != INFO_VERSION {
            return Err(bad(&format!("version {}, this build speaks {INFO_VERSION}", u16_at(4))));
        }
        if !(1..=5).contains(&b[6]) {
            return Err(bad(&format!("MTU code {}", b[6])));
        }
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[20..36]);
        let qp = QpInfo { mtu: b[6], qpn: u32_at(8), psn: u32_at(12), lid: u16_at(16), gid };
        let geometry = Geometry { slots: u32_at(56) as usize, slot_bytes: u32_at(60) as usize };
        geometry.check().map_err(|e| bad(e.detail()))?;
        let len = u64_at(44);
        if len != geometry.bytes() as u64 || u64_at(36).checked_add(len).is_none() {
            return Err(bad(&format!(
                "a ring of {len} bytes for {} slots of {}",
                geometry.slots, geometry.slot_bytes
            )));
        }
        let ring = RemoteRegion { addr: u64_at(36), len: len as usize, rkey: u32_at(52) };
        Ok(RingInfo { qp, ring, geometry })
    }
}
