//! A TCP or UDP header that is cut short or out of range. The balancer
//! drops it when the packet is addressed to the balancer itself: a VIP's
//! port, or a SNAT tuple (whose replies the host must never see). Other
//! traffic is transit or the host's own, and passes to the stack as
//! not-VIP traffic: a router forwards a packet without reading its
//! transport header, and the host's own TCP and UDP count and drop what
//! they cannot read, so a malformed header costs traffic that is not ours
//! nothing. A datagram too short to hold the destination port cannot be
//! told apart from a VIP's, and is dropped as before.
use lb_common::{CONFIG_F_READY, LbConfig, Reason, StageResult, Verdict, VipKey, reason};

use crate::maps::{self, CONFIG, VIPS};

/// [`BadTransport::dport`] of a datagram that ends before its destination
/// port (no port has this value).
pub const NO_PORT: u32 = u32::MAX;

/// What the parser read of a packet before its transport header failed.
pub struct BadTransport {
    /// Why it failed (`DROP_TRUNCATED` or `DROP_BAD_HEADER`).
    pub reason: Reason,
    pub family: u8,
    pub proto: u8,
    /// The destination port (network byte order), or [`NO_PORT`] if the
    /// datagram does not get that far.
    pub dport: u32,
    pub daddr: [u32; 4],
}

/// Drops `bad` under its reason if it is addressed to the balancer (or
/// has no destination port to tell), else passes it as `PASS_NOT_VIP`. A
/// BPF function of its own, so its two map keys stay out of the parser's
/// stack frame. Before the control plane is ready only what has no port to tell
/// is dropped (the pipeline passes everything then).
/// Returns the verdict as a [`StageResult`]: a BPF function cannot return
/// a struct.
#[inline(never)]
pub fn verdict(bad: &BadTransport) -> StageResult {
    let ours = match CONFIG.get(0) {
        Some(cfg) if cfg.flags & CONFIG_F_READY != 0 => addressed_to_balancer(bad, cfg),
        _ => bad.dport == NO_PORT,
    };
    StageResult::verdict(if ours {
        Verdict::drop(bad.reason)
    } else {
        Verdict::pass(reason::PASS_NOT_VIP)
    })
}

/// Without a destination port, always (it cannot be told); else a SNAT
/// tuple ([`maps::is_snat_tuple`], as the pipeline asks of a packet of no
/// flow), or a VIP's address, port and protocol.
#[inline(always)]
fn addressed_to_balancer(bad: &BadTransport, cfg: &LbConfig) -> bool {
    if bad.dport == NO_PORT {
        return true;
    }
    let port = bad.dport as u16;
    if maps::is_snat_tuple(bad.daddr, bad.family, port, cfg) {
        return true;
    }
    let vip = VipKey {
        addr: bad.daddr,
        port,
        proto: bad.proto,
        family: bad.family,
    };
    // SAFETY: read-only presence test.
    unsafe { VIPS.get(&vip) }.is_some()
}
