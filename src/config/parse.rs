//! The value syntaxes of the environment variables: numbers, sizes with K/M/G suffixes, rates
//! as `tc` writes them, booleans, seconds, the wire data type. Each error names the variable
//! and the value, so a user sees what to fix.

use std::time::Duration;

use super::MAX_TIMEOUT;
use crate::error::{Error, Result};

pub(super) fn parse_num<T: std::str::FromStr>(name: &str, v: &str) -> Result<T> {
    v.parse().map_err(|_| Error::InvalidArgument(format!("{name}={v}: not a number").into()))
}

/// `TOROID_WIRE_DTYPE`: `bf16` (`bfloat16`), `f16` (`half`, `float16`) or `none`.
pub(super) fn parse_wire(v: &str) -> Result<Option<crate::dtype::DataType>> {
    use crate::dtype::DataType;
    match v.to_ascii_lowercase().as_str() {
        "bf16" | "bfloat16" => Ok(Some(DataType::BF16)),
        "f16" | "half" | "float16" => Ok(Some(DataType::F16)),
        "none" | "off" => Ok(None),
        _ => Err(Error::InvalidArgument(format!("TOROID_WIRE_DTYPE={v}: expected bf16, f16 or none").into())),
    }
}

/// A rate as `tc` writes it (`kbit`, `mbit`, `gbit`: powers of 1000 bits per second) or plain
/// bytes per second; returns bytes per second.
pub(super) fn parse_rate(name: &str, v: &str) -> Result<u64> {
    let l = v.trim().to_ascii_lowercase();
    let (digits, bits) = [("kbit", 1e3), ("mbit", 1e6), ("gbit", 1e9), ("bit", 1.0)]
        .iter()
        .find_map(|(u, m)| l.strip_suffix(u).map(|d| (d.to_string(), Some(*m))))
        .unwrap_or((l.clone(), None));
    let n: f64 = parse_num(name, digits.trim())?;
    let bytes = match bits {
        Some(m) => n * m / 8.0,
        None => n,
    };
    if !(1.0..1e15).contains(&bytes) {
        return Err(Error::InvalidArgument(format!("{name}={v}: expected a rate such as 1gbit").into()));
    }
    Ok(bytes as u64)
}

/// `1`/`0`, `true`/`false`, `yes`/`no`, `on`/`off`.
pub(super) fn parse_bool(name: &str, v: &str) -> Result<bool> {
    match v.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(Error::InvalidArgument(format!("{name}={v}: expected 1 or 0").into())),
    }
}

/// Seconds, possibly fractional (`0.5`).
pub(super) fn parse_seconds(name: &str, v: &str) -> Result<Duration> {
    let secs: f64 = parse_num(name, v)?;
    if !(secs > 0.0 && secs.is_finite()) {
        return Err(Error::InvalidArgument(
            format!("{name}={v}: must be a positive number of seconds").into(),
        ));
    }
    if secs > MAX_TIMEOUT.as_secs_f64() {
        return Err(Error::InvalidArgument(
            format!("{name}={v}: above the maximum of {} s (30 days)", MAX_TIMEOUT.as_secs()).into(),
        ));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// A byte size with an optional K/M/G suffix (powers of 1024, as nccl-tests reads sizes).
///
/// ```
/// assert_eq!(toroid::internals::config::parse_size("x", "4K").unwrap(), 4096);
/// assert_eq!(toroid::internals::config::parse_size("x", "64M").unwrap(), 64 << 20);
/// assert_eq!(toroid::internals::config::parse_size("x", "100").unwrap(), 100);
/// ```
pub fn parse_size(name: &str, v: &str) -> Result<usize> {
    let v = v.trim();
    let (digits, shift) = match v.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&v[..v.len() - 1], 10),
        Some('M') => (&v[..v.len() - 1], 20),
        Some('G') => (&v[..v.len() - 1], 30),
        Some('T') => (&v[..v.len() - 1], 40),
        _ => (v, 0),
    };
    let n: usize = parse_num(name, digits)?;
    n.checked_mul(1usize << shift)
        .ok_or_else(|| Error::InvalidArgument(format!("{name}={v}: too large").into()))
}
