//! Admission and backend selection for the first packet of a connection,
//! in a *global* BPF function ([`lb_pick_backend`]: `#[no_mangle]`, so
//! bpf-linker gives it global BTF linkage). The verifier checks a global
//! function once, on its own, instead of once for every distinct state
//! `lb_xdp` reaches the call in; inlined, the parse paths times the
//! algorithms' paths exceeded the one-million-instruction limit.
//!
//! A global function may take only scalars (or pointers the verifier then
//! treats as clobbered memory), so the packet's 5-tuple travels as five
//! `u64`s and is unpacked into a [`Packet`] of the function's own. It runs
//! next to `new_flow`, not inside it, so the algorithms' locals stay out of
//! the deepest stack frame.
use lb_common::{VipKey, reason};

use crate::{Reason, Verdict, finish, maps::VIPS, now, parse::Packet, rate, select};

/// [`pick_backend`]'s flag for "the low word is the packet's XDP action,
/// already counted", as opposed to a `(vip_id << 32) | backend_id` pick.
pub const PICK_DONE: u64 = 1 << 63;

/// Admits the new flow `pkt` and selects its backend: returns
/// `(vip_id << 32) | backend_id`, or `PICK_DONE | action`.
#[inline(always)]
pub fn pick_backend(pkt: &Packet) -> u64 {
    let (s, d) = (pkt.saddr, pkt.daddr);
    lb_pick_backend(
        words(s[0], s[1]),
        words(s[2], s[3]),
        words(d[0], d[1]),
        words(d[2], d[3]),
        pack_rest(pkt),
    )
}

#[inline(always)]
fn words(low: u32, high: u32) -> u64 {
    u64::from(low) | (u64::from(high) << 32)
}

/// Ports, protocol, family and TCP flags in one `u64`.
#[inline(always)]
fn pack_rest(pkt: &Packet) -> u64 {
    u64::from(pkt.sport)
        | (u64::from(pkt.dport) << 16)
        | (u64::from(pkt.proto) << 32)
        | (u64::from(pkt.family) << 40)
        | (u64::from(pkt.tcp_flags) << 48)
}

/// The global function; see the module documentation.
#[unsafe(no_mangle)]
#[inline(never)]
pub fn lb_pick_backend(s01: u64, s23: u64, d01: u64, d23: u64, rest: u64) -> u64 {
    let pkt = Packet {
        l3: 0,
        l4: 0,
        proto: (rest >> 32) as u8,
        family: (rest >> 40) as u8,
        saddr: [
            s01 as u32,
            (s01 >> 32) as u32,
            s23 as u32,
            (s23 >> 32) as u32,
        ],
        daddr: [
            d01 as u32,
            (d01 >> 32) as u32,
            d23 as u32,
            (d23 >> 32) as u32,
        ],
        sport: rest as u16,
        dport: (rest >> 16) as u16,
        tcp_flags: (rest >> 48) as u8,
        payload_len: 0,
        frame_len: 0,
    };
    match try_pick(&pkt) {
        Ok(Ok((vip_id, backend_id))) => (u64::from(vip_id) << 32) | u64::from(backend_id),
        Ok(Err(verdict)) => PICK_DONE | u64::from(finish(Ok(verdict))),
        Err(reason) => PICK_DONE | u64::from(finish(Err(reason))),
    }
}

#[inline(always)]
fn try_pick(pkt: &Packet) -> Result<Result<(u32, u32), Verdict>, Reason> {
    let vip_key = VipKey {
        addr: pkt.daddr,
        port: pkt.dport,
        proto: pkt.proto,
        family: pkt.family,
    };
    // SAFETY: read-only use of a hash map value.
    let Some(vip) = (unsafe { VIPS.get(vip_key) }) else {
        return Ok(Err(Verdict::pass(reason::PASS_NOT_VIP)));
    };
    if pkt.is_tcp() && !pkt.is_syn() {
        return Err(reason::DROP_NO_FLOW);
    }
    rate::admit(now())?;
    let backend = select::select(vip, pkt)?;
    Ok(Ok((vip.vip_id, backend.id)))
}
