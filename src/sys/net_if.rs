//! The addresses of this host's network interfaces (`getifaddrs(3)`).

use std::ffi::CStr;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// One address of one interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IfAddr {
    /// Interface name (`eth0`, `lo`).
    pub name: String,
    /// The address.
    pub addr: IpAddr,
}

/// The list `getifaddrs` allocates, freed once on drop.
struct List(*mut libc::ifaddrs);

impl Drop for List {
    fn drop(&mut self) {
        // SAFETY: the pointer came from a successful getifaddrs and is freed only here.
        unsafe { libc::freeifaddrs(self.0) };
    }
}

/// The IPv4 and IPv6 addresses of every interface that is up, in the kernel's order.
pub fn up_addresses() -> io::Result<Vec<IfAddr>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head into the live `head`; `List` frees it.
    super::syscall!(getifaddrs(&mut head))?;
    let list = List(head);
    let mut out = Vec::new();
    let mut cur = list.0;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, alive until `list` drops.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_flags & libc::IFF_UP as libc::c_uint == 0 {
            continue;
        }
        // SAFETY: ifa_addr is non-null and points at a sockaddr whose family says its real type.
        let addr = unsafe {
            match i32::from((*ifa.ifa_addr).sa_family) {
                libc::AF_INET => {
                    let sa = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                    IpAddr::V4(Ipv4Addr::from(u32::from_be(sa.sin_addr.s_addr)))
                }
                libc::AF_INET6 => {
                    let sa = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                    IpAddr::V6(Ipv6Addr::from(sa.sin6_addr.s6_addr))
                }
                _ => continue,
            }
        };
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        let name = unsafe { CStr::from_ptr(ifa.ifa_name) }.to_string_lossy().into_owned();
        out.push(IfAddr { name, addr });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #[test]
    fn loopback_is_listed_with_its_address() {
        let all = super::up_addresses().unwrap();
        assert!(all.iter().any(|i| i.name == "lo" && i.addr.is_loopback()), "{all:?}");
    }
}
