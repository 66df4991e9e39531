//! Which address a rank listens on: the interfaces that are up, filtered by
//! `TOROID_SOCKET_IFNAME` (NCCL's `NCCL_SOCKET_IFNAME` syntax), else the route towards the store.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs, UdpSocket};

use crate::error::{Error, Result};
use crate::sys::net_if;

/// One address of one interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interface {
    /// Interface name (`eth0`, `lo`).
    pub name: String,
    /// One of its addresses.
    pub addr: IpAddr,
}

/// Lists the IPv4 and IPv6 addresses of every interface that is up.
pub fn interfaces() -> Result<Vec<Interface>> {
    let all = net_if::up_addresses().map_err(|e| Error::system("getifaddrs", e))?;
    Ok(all.into_iter().map(|i| Interface { name: i.name, addr: i.addr }).collect())
}

/// Filters interfaces by NCCL's `NCCL_SOCKET_IFNAME` syntax: a comma list of name prefixes;
/// a leading `^` excludes instead; a leading `=` asks for exact names.
pub fn select_interfaces(all: &[Interface], spec: &str) -> Vec<Interface> {
    let (exclude, rest) = match spec.strip_prefix('^') {
        Some(r) => (true, r),
        None => (false, spec),
    };
    let (exact, rest) = match rest.strip_prefix('=') {
        Some(r) => (true, r),
        None => (false, rest),
    };
    let names: Vec<&str> = rest.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
    let matches = |n: &str| names.iter().any(|p| if exact { n == *p } else { n.starts_with(p) });
    all.iter().filter(|i| matches(&i.name) != exclude).cloned().collect()
}

/// An IPv6 link-local address (`fe80::/10`): useless to peers without a scope id.
fn is_link_local(i: &Interface) -> bool {
    matches!(i.addr, IpAddr::V6(a) if (a.segments()[0] & 0xffc0) == 0xfe80)
}

/// Picks the address this rank listens on.
///
/// With `ifname` set, the first matching interface (IPv4 first unless `family` is
/// `AF_INET6`), or an error listing what exists. Without it, the local address of the route
/// towards `store_host` (the address every rank can already reach), else the first interface
/// that is not loopback or docker, else loopback.
pub fn choose_address(
    ifname: Option<&str>,
    family: Option<&str>,
    store_host: Option<&str>,
) -> Result<Interface> {
    let all = interfaces()?;
    let want_v6 = matches!(
        family.map(str::to_ascii_uppercase).as_deref(),
        Some("AF_INET6") | Some("INET6") | Some("IPV6")
    );
    let family_ok = |i: &Interface| i.addr.is_ipv6() == want_v6;
    let listing = || all.iter().map(|i| format!("{} ({})", i.name, i.addr)).collect::<Vec<_>>().join(", ");
    if let Some(spec) = ifname {
        let mut chosen = select_interfaces(&all, spec);
        // Prefer the requested family but accept the other rather than fail.
        chosen.sort_by_key(|i| !family_ok(i));
        chosen.retain(|i| !is_link_local(i));
        return chosen.into_iter().next().ok_or_else(|| {
            Error::InvalidArgument(
                format!(
                    "TOROID_SOCKET_IFNAME={spec} matches no interface that is up; available: {}",
                    listing()
                )
                .into(),
            )
        });
    }
    if let Some(host) = store_host
        && let Some(local) = route_source(host)
    {
        let name = all.iter().find(|i| i.addr == local).map(|i| i.name.clone()).unwrap_or_default();
        return Ok(Interface { name, addr: local });
    }
    let candidates = select_interfaces(&all, "^lo,docker,virbr");
    let pick = candidates
        .iter()
        .filter(|i| !is_link_local(i))
        .find(|i| family_ok(i))
        .or_else(|| candidates.first())
        .cloned();
    Ok(pick.unwrap_or(Interface { name: "lo".into(), addr: IpAddr::V4(Ipv4Addr::LOCALHOST) }))
}

/// The local address the kernel would use to reach `host` (no packet is sent: a UDP connect
/// only picks a route).
fn route_source(host: &str) -> Option<IpAddr> {
    let target = (host, 9).to_socket_addrs().ok()?.next()?;
    let bind: SocketAddr =
        if target.is_ipv4() { (Ipv4Addr::UNSPECIFIED, 0).into() } else { (Ipv6Addr::UNSPECIFIED, 0).into() };
    let sock = UdpSocket::bind(bind).ok()?;
    sock.connect(target).ok()?;
    sock.local_addr().ok().map(|a| a.ip())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ifs(names: &[&str]) -> Vec<Interface> {
        names
            .iter()
            .map(|n| Interface { name: n.to_string(), addr: IpAddr::V4(Ipv4Addr::LOCALHOST) })
            .collect()
    }

    #[test]
    fn ifname_syntax_matches_nccl() {
        let all = ifs(&["lo", "eth0", "eth1", "docker0", "ib0"]);
        let names =
            |spec: &str| select_interfaces(&all, spec).into_iter().map(|i| i.name).collect::<Vec<_>>();
        assert_eq!(names("eth"), ["eth0", "eth1"]);
        assert_eq!(names("=eth"), Vec::<String>::new());
        assert_eq!(names("=eth1"), ["eth1"]);
        assert_eq!(names("^lo,docker"), ["eth0", "eth1", "ib0"]);
        assert_eq!(names("ib,lo"), ["lo", "ib0"]);
    }

    #[test]
    fn unknown_ifname_is_a_clear_error() {
        let e = choose_address(Some("nosuchif0"), None, None).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("nosuchif0") && msg.contains("available") && msg.contains("lo"), "{msg}");
    }

    #[test]
    fn loopback_store_routes_over_loopback() {
        let i = choose_address(None, None, Some("127.0.0.1")).unwrap();
        assert!(i.addr.is_loopback());
    }
}
