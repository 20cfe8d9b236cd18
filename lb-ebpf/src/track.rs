//! Connection tracking. State lives in the forward (client → backend) entry;
//! both directions update it, and ring-buffer events go out only when the
//! state changes. Bits that several CPUs may race on are set and cleared
//! with atomic read-modify-writes, and only the CPU that flipped a bit acts.
use core::mem::offset_of;

use lb_common::{
    CLOSE_BACKEND_RST, CLOSE_FIN, CLOSE_RST, EVENT_CLOSED, EVENT_OPENED, EVENT_REFUSED,
    EVENT_RESPONDED, FLOW_CLOSING, FLOW_ESTABLISHED, FLOW_F_CLOSED, FLOW_F_REQUEST_PENDING,
    FLOW_F_SYNACK_SEEN, FlowEntry,
};

use crate::{
    atomic::{add_u64, fetch_add_u64, fetch_and_u64, fetch_or_u64},
    events::emit,
    maps::BACKEND_CONNS,
    packet::Packet,
    progress,
    wire::{TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN},
};

/// `last_seen_ns` is refreshed at most this often, to avoid a store (and a
/// cache line bounce between CPUs) on every packet.
const LAST_SEEN_GRANULARITY_NS: u64 = 1_000_000_000;

/// A new connection to `backend_id`: count it open and announce it.
#[inline(always)]
pub fn opened(backend_id: u32, vip_id: u32, now: u64) {
    if let Some(conns) = BACKEND_CONNS.get_ptr_mut(backend_id) {
        // SAFETY: live, 8-byte aligned map value; every writer is atomic.
        let before = unsafe { fetch_add_u64(&raw mut (*conns).opened, 1) };
        progress::connected(backend_id, before, now);
    }
    emit(EVENT_OPENED, 0, backend_id, vip_id, now, 0);
}

/// A client packet of the connection whose forward entry is `fwd`.
#[inline(always)]
pub fn client_packet(pkt: &Packet, fwd: *mut FlowEntry, now: u64) {
    touch(fwd, now);
    let flags = Flags::of(fwd);
    if pkt.payload_len > 0 && flags.get() & FLOW_F_REQUEST_PENDING == 0 {
        // The time is stored before the flag is published; the reply path
        // reads it only after clearing the flag.
        // SAFETY: live map value.
        unsafe { (*fwd).request_ns = now };
        flags.set(FLOW_F_REQUEST_PENDING);
    }
    if pkt.has(TCP_RST) {
        close(fwd, EVENT_CLOSED, CLOSE_RST, now);
    } else if pkt.has(TCP_FIN) {
        close(fwd, EVENT_CLOSED, CLOSE_FIN, now);
    }
}

/// A backend packet of the connection whose forward entry is `fwd`.
#[inline(always)]
pub fn backend_packet(pkt: &Packet, fwd: *mut FlowEntry, now: u64) {
    touch(fwd, now);
    let flags = Flags::of(fwd);
    if pkt.has(TCP_SYN) && pkt.has(TCP_ACK) && flags.get() & FLOW_F_SYNACK_SEEN == 0 {
        flags.set(FLOW_F_SYNACK_SEEN);
        // SAFETY: live map value; a racing writer stores the same value.
        unsafe { (*fwd).state = FLOW_ESTABLISHED };
    }
    if pkt.has(TCP_RST) {
        // An RST before any SYN-ACK is a refused connection; REFUSED is then
        // its only terminal event (no CLOSED follows). After it, the backend
        // reset a live connection.
        let (kind, close_reason) = if flags.get() & FLOW_F_SYNACK_SEEN == 0 {
            (EVENT_REFUSED, CLOSE_RST)
        } else {
            (EVENT_CLOSED, CLOSE_BACKEND_RST)
        };
        close(fwd, kind, close_reason, now);
    } else if pkt.has(TCP_FIN) {
        close(fwd, EVENT_CLOSED, CLOSE_FIN, now);
    }
    if pkt.payload_len > 0 && flags.get() & FLOW_F_REQUEST_PENDING != 0 {
        let before = flags.clear(FLOW_F_REQUEST_PENDING);
        if before & FLOW_F_REQUEST_PENDING != 0 {
            // SAFETY: live map value.
            let (request_ns, backend_id, vip_id) =
                unsafe { ((*fwd).request_ns, (*fwd).backend_id, (*fwd).vip_id) };
            progress::answered(backend_id, now);
            emit(
                EVENT_RESPONDED,
                0,
                backend_id,
                vip_id,
                now,
                now.saturating_sub(request_ns),
            );
        }
    }
}

/// Counts the connection closed, once: only the CPU that sets
/// `FLOW_F_CLOSED` advances `closed` and emits the event. The entries stay
/// so the rest of the FIN handshake is still translated.
#[inline(always)]
fn close(fwd: *mut FlowEntry, kind: u8, close_reason: u8, now: u64) {
    if Flags::of(fwd).set(FLOW_F_CLOSED) & FLOW_F_CLOSED != 0 {
        return;
    }
    // SAFETY: live map value.
    let (backend_id, vip_id) = unsafe {
        (*fwd).state = FLOW_CLOSING;
        ((*fwd).backend_id, (*fwd).vip_id)
    };
    if let Some(conns) = BACKEND_CONNS.get_ptr_mut(backend_id) {
        // SAFETY: live, 8-byte aligned map value; every writer is atomic.
        unsafe { add_u64(&raw mut (*conns).closed, 1) };
    }
    emit(kind, close_reason, backend_id, vip_id, now, 0);
}

/// Refreshes `last_seen_ns` when it is more than a granule old.
#[inline(always)]
fn touch(fwd: *mut FlowEntry, now: u64) {
    // SAFETY: live map value; a torn race only writes a similar timestamp.
    unsafe {
        if now.saturating_sub((*fwd).last_seen_ns) > LAST_SEEN_GRANULARITY_NS {
            (*fwd).last_seen_ns = now;
        }
    }
}

// `Flags` updates `flags` through the 64-bit word it shares with `_pad2`.
const _: () = {
    assert!(offset_of!(FlowEntry, flags) % 8 == 0);
    assert!(offset_of!(FlowEntry, _pad2) == offset_of!(FlowEntry, flags) + 4);
};

/// Atomic access to the `u32` flags of a live flow entry. BPF CPU v1 has
/// only 64-bit atomics, so the bits are set and cleared in the aligned word
/// made of `flags` and `_pad2` (which stays zero).
#[derive(Clone, Copy)]
struct Flags(*mut u64);

impl Flags {
    #[inline(always)]
    fn of(fwd: *mut FlowEntry) -> Self {
        // SAFETY: only computes the field address.
        Self(unsafe { (&raw mut (*fwd).flags).cast::<u64>() })
    }

    /// Position of `flags` inside the word.
    #[inline(always)]
    const fn widen(bits: u32) -> u64 {
        if cfg!(target_endian = "little") {
            bits as u64
        } else {
            (bits as u64) << 32
        }
    }

    #[inline(always)]
    const fn narrow(word: u64) -> u32 {
        if cfg!(target_endian = "little") {
            word as u32
        } else {
            (word >> 32) as u32
        }
    }

    /// A plain load, for cheap checks before an atomic update.
    #[inline(always)]
    fn get(self) -> u32 {
        // SAFETY: aligned word inside a live map value (RCU keeps it alive
        // for the whole program run); aligned loads are single instructions.
        Self::narrow(unsafe { self.0.read_volatile() })
    }

    /// Sets `bits`, returning the flags from before.
    #[inline(always)]
    fn set(self, bits: u32) -> u32 {
        // SAFETY: as in `get`.
        Self::narrow(unsafe { fetch_or_u64(self.0, Self::widen(bits)) })
    }

    /// Clears `bits`, returning the flags from before.
    #[inline(always)]
    fn clear(self, bits: u32) -> u32 {
        // SAFETY: as in `get`.
        Self::narrow(unsafe { fetch_and_u64(self.0, !Self::widen(bits)) })
    }
}
