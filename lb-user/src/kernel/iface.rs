//! Facts about the network interface the balancer attaches to.

use std::{
    ffi::CString,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    process::Command,
};

use anyhow::{Context as _, anyhow, bail};
use nix::ifaddrs::getifaddrs;

use crate::kernel::batch::sys_bpf;

/// The interface's index, or a one-line error naming it.
pub fn ifindex(name: &str) -> anyhow::Result<u32> {
    let c_name = CString::new(name).map_err(|_| anyhow!("invalid interface name '{name}'"))?;
    // SAFETY: `c_name` is a valid NUL-terminated string.
    let index = unsafe { libc::if_nametoindex(c_name.as_ptr()) };
    if index == 0 {
        bail!("unknown interface '{name}'");
    }
    Ok(index)
}

/// The first IPv4 address on the interface (the kernel lists the primary
/// address of a subnet before its secondaries) that is not a loopback one;
/// a loopback one only if it has no other (which the start then refuses
/// as a SNAT address, saying why: `daemon::startup::Snat`).
pub fn primary_ipv4(name: &str) -> anyhow::Result<Ipv4Addr> {
    let addrs: Vec<Ipv4Addr> = getifaddrs()
        .context("listing interface addresses")?
        .filter(|a| a.interface_name == name)
        .filter_map(|a| {
            a.address
                .and_then(|s| s.as_sockaddr_in().map(|sin| sin.ip()))
        })
        .collect();
    first_not_loopback(&addrs)
        .ok_or_else(|| anyhow!("interface '{name}' has no IPv4 address; give --snat-ip"))
}

/// The first of `addrs` that is not a loopback address, else the first.
fn first_not_loopback(addrs: &[Ipv4Addr]) -> Option<Ipv4Addr> {
    addrs
        .iter()
        .find(|a| !a.is_loopback())
        .or(addrs.first())
        .copied()
}

/// Every address of every interface of this network namespace.
pub fn local_addresses() -> anyhow::Result<Vec<IpAddr>> {
    Ok(getifaddrs()
        .context("listing interface addresses")?
        .filter_map(|a| {
            let s = a.address?;
            s.as_sockaddr_in()
                .map(|sin| IpAddr::V4(sin.ip()))
                .or_else(|| s.as_sockaddr_in6().map(|sin6| IpAddr::V6(sin6.ip())))
        })
        .collect())
}

/// A global-scope IPv6 address of the interface (not link-local, loopback
/// or multicast; unique local addresses count as global, as the kernel's
/// scope says). An address of a subnet is preferred over a /128, which is
/// usually a VIP.
pub fn global_ipv6(name: &str) -> anyhow::Result<Ipv6Addr> {
    let candidates: Vec<(Ipv6Addr, bool)> = getifaddrs()
        .context("listing interface addresses")?
        .filter(|a| a.interface_name == name)
        .filter_map(|a| {
            let ip = a.address?.as_sockaddr_in6()?.ip();
            let host_route = a
                .netmask
                .and_then(|m| {
                    m.as_sockaddr_in6()
                        .map(|m| m.ip() == Ipv6Addr::from(u128::MAX))
                })
                .unwrap_or(false);
            Some((ip, host_route))
        })
        .filter(|(ip, _)| !ip.is_loopback() && !ip.is_multicast() && !ip.is_unicast_link_local())
        .collect();
    candidates
        .iter()
        .find(|(_, host_route)| !host_route)
        .or(candidates.first())
        .map(|(ip, _)| *ip)
        .ok_or_else(|| anyhow!("interface '{name}' has no global IPv6 address; give --snat-ip6"))
}

/// Id of the XDP program attached to the interface (in this network
/// namespace), from `ip -j link show`. `None` if none is attached.
pub fn attached_xdp_program(name: &str) -> anyhow::Result<Option<u32>> {
    let output = Command::new("ip")
        .args(["-j", "link", "show", "dev", name])
        .output()
        .context("running `ip -j link show` (is iproute2 installed?)")?;
    if !output.status.success() {
        bail!(
            "`ip link show dev {name}` failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    let links: serde_json::Value =
        serde_json::from_slice(&output.stdout).context("parsing `ip -j link show` output")?;
    Ok(links
        .get(0)
        .and_then(|link| link.get("xdp"))
        .and_then(find_prog_id))
}

/// iproute2 prints `"xdp":{"mode":N,"prog":{"id":ID,..}}` for one program and
/// `"xdp":{"attached":[{"mode":N,"prog":{..}}]}` for several modes at once.
fn find_prog_id(xdp: &serde_json::Value) -> Option<u32> {
    if let Some(id) = xdp.pointer("/prog/id").and_then(|v| v.as_u64()) {
        return u32::try_from(id).ok();
    }
    xdp.get("attached")?
        .as_array()?
        .iter()
        .find_map(find_prog_id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_prog_id_in_both_iproute2_shapes() {
        let single: serde_json::Value =
            serde_json::from_str(r#"{"mode":1,"prog":{"id":42,"name":"lb_xdp"}}"#).unwrap();
        assert_eq!(find_prog_id(&single), Some(42));
        let multi: serde_json::Value =
            serde_json::from_str(r#"{"attached":[{"mode":2,"prog":{"id":7}}]}"#).unwrap();
        assert_eq!(find_prog_id(&multi), Some(7));
        assert_eq!(find_prog_id(&serde_json::json!({})), None);
    }

    #[test]
    fn the_default_snat_address_is_the_first_that_is_not_loopback() {
        let a = |s: &str| s.parse::<Ipv4Addr>().unwrap();
        assert_eq!(
            first_not_loopback(&[a("127.0.0.2"), a("10.0.0.1"), a("10.0.0.2")]),
            Some(a("10.0.0.1"))
        );
        // Only loopback: that one, for the start to refuse by name.
        assert_eq!(first_not_loopback(&[a("127.0.0.1")]), Some(a("127.0.0.1")));
        assert_eq!(first_not_loopback(&[]), None);
    }

    #[test]
    fn loopback_exists_and_unknown_interfaces_are_named() {
        assert!(ifindex("lo").unwrap() > 0);
        assert_eq!(
            ifindex("nosuchif0").unwrap_err().to_string(),
            "unknown interface 'nosuchif0'"
        );
    }
}

/// `bpf(2)` commands [`pinned_xdp_link_ifindex`] makes.
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;

/// The `BPF_OBJ_GET` attribute: a pinned object's path.
#[repr(C)]
#[derive(Default)]
struct ObjGetAttr {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
}

/// The `BPF_OBJ_GET_INFO_BY_FD` attribute.
#[repr(C)]
#[derive(Default)]
struct InfoAttr {
    bpf_fd: u32,
    info_len: u32,
    info: u64,
}

/// Where `struct bpf_link_info` keeps an XDP link's `ifindex`: after
/// `type`, `id` and `prog_id`, at the start of its 8-byte aligned union.
const LINK_INFO_XDP_IFINDEX: usize = 16;

/// The interface index the XDP link pinned at `path` is attached to, in
/// whatever network namespace that interface is: 0 for a link whose
/// interface is gone (defunct). aya's `LinkInfo` does not expose it.
pub fn pinned_xdp_link_ifindex(path: &std::path::Path) -> anyhow::Result<u32> {
    use std::os::fd::{FromRawFd as _, OwnedFd};
    let c_path = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| anyhow!("invalid pin path {}", path.display()))?;
    let mut get = ObjGetAttr {
        pathname: c_path.as_ptr() as u64,
        ..ObjGetAttr::default()
    };
    // SAFETY: `get` points at a NUL-terminated path that outlives the call.
    let fd = unsafe { sys_bpf(BPF_OBJ_GET, &mut get) }
        .with_context(|| format!("opening the pinned link {}", path.display()))?;
    // SAFETY: a new fd that the kernel just handed to this process.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let mut info = [0u8; 64];
    let mut attr = InfoAttr {
        bpf_fd: std::os::fd::AsRawFd::as_raw_fd(&fd) as u32,
        info_len: info.len() as u32,
        info: info.as_mut_ptr() as u64,
    };
    // SAFETY: `attr` points at a zeroed buffer of `info_len` bytes that
    // outlives the call (the kernel writes at most that many).
    unsafe { sys_bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr) }
        .with_context(|| format!("reading the pinned link {}", path.display()))?;
    let at = LINK_INFO_XDP_IFINDEX;
    Ok(u32::from_ne_bytes([
        info[at],
        info[at + 1],
        info[at + 2],
        info[at + 3],
    ]))
}
