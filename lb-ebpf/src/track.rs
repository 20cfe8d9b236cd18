//! Connection tracking. State lives in the forward (client → backend) entry;
//! both directions update it, and ring-buffer events go out only when the
//! state changes. A backend packet finds the forward entry through a second
//! lookup, so the reply path does that only when the packet needs the
//! state (`reply_refresh_due`, `reply_needs_state`): its flags (SYN, FIN,
//! RST), a response to a pending request (mirrored into the reply entry by
//! the forward path), or the once-a-second `last_seen_ns` refresh. Bits
//! that several CPUs may race on are set and cleared with atomic
//! read-modify-writes, and only the CPU that flipped a bit acts.
//!
//! A TCP connection is closed after both FINs (one from each side: a
//! half-closed transfer is still in flight) or after an RST from either
//! side. The RST is not checked against the sequence window: the balancer
//! tracks no sequence numbers, and an RST must carry the connection's exact
//! tuple (the backend side's includes the SNAT port); closing only ends the
//! accounting, while both entries keep translating for `closed_linger_ns`,
//! so a spoofed RST does not cut the connection at once. On close, both
//! entries are stamped with the close time: the forward entry lingers from
//! it, and the reply entry keeps the SNAT tuple in quarantine from it.
use lb_common::{
    CLOSE_BACKEND_RST, CLOSE_FIN, CLOSE_RST, EVENT_CLOSED, EVENT_REFUSED, FLOW_CLOSING,
    FLOW_ESTABLISHED, FLOW_F_CLOSED, FLOW_F_FIN_BACKEND, FLOW_F_FIN_CLIENT, FLOW_F_PENDING_COUNTED,
    FLOW_F_REQUEST_PENDING, FLOW_F_SYNACK_SEEN, FlowEntry, FlowKey,
};

use crate::{
    atomic::{Flags, add_u64},
    events::emit,
    flow::{Translation, lookup, stamp_closed},
    helpers::{PacketClock, jiffies},
    maps::{BACKEND_CONNS, BACKEND_HANDSHAKES, BACKEND_LATENCY, LATENCY_EPOCH},
    packet::Packet,
    progress,
    wire::{TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN},
};

/// `last_seen_ns` is refreshed at most this often, to avoid a store (and a
/// cache line bounce between CPUs) on every packet.
const LAST_SEEN_GRANULARITY_NS: u64 = 1_000_000_000;

/// Bulk packets compare the precise clock with `last_seen_ns` only when
/// this many jiffies passed since the entry's last such check
/// (`FlowEntry::checked_jiffies`): once a second at HZ=100, ten times at
/// HZ=1000. The refresh itself stays once a second; it comes at most this
/// much later.
const REFRESH_CHECK_JIFFIES: u32 = 100;

/// A new connection to `backend_id`: count it open (a counter, no event).
#[inline(always)]
pub fn opened(backend_id: u32) {
    if let Some(conns) = BACKEND_CONNS.get_ptr_mut(backend_id) {
        // SAFETY: live, 8-byte aligned map value; every writer is atomic.
        unsafe { add_u64(&raw mut (*conns).opened, 1) };
    }
}

/// A client packet of the connection whose forward entry is `fwd`.
/// The clock is read only for a request, a close, or a due refresh.
#[inline(always)]
pub fn client_packet<const V6: bool>(pkt: &Packet, fwd: *mut FlowEntry, clock: &mut PacketClock) {
    let flags = Flags::of(fwd);
    if flags.get() & FLOW_F_CLOSED == 0 && refresh_check_due(fwd) {
        touch(fwd, flags, clock.now());
        // Still sending while its request waits: one-way traffic, whose
        // backend keeps a capped stall age (`progress::still_sending`).
        if pkt.payload_len > 0 && flags.get() & FLOW_F_REQUEST_PENDING != 0 {
            // SAFETY: live map value.
            progress::still_sending(unsafe { (*fwd).backend_id }, clock.now());
        }
    }
    if pkt.payload_len > 0 && flags.get() & FLOW_F_REQUEST_PENDING == 0 {
        // The time is stored before the flag is published; the reply path
        // reads it only after clearing the flag.
        // SAFETY: live map value.
        unsafe { (*fwd).request_ns = clock.now() };
        if flags.set(FLOW_F_REQUEST_PENDING) & FLOW_F_REQUEST_PENDING == 0 {
            // Late data of a closed connection waits for no answer: it
            // must not start the backend's stall clock (`progress`).
            if flags.get() & FLOW_F_CLOSED == 0 {
                // SAFETY: live map value.
                progress::requested(unsafe { (*fwd).backend_id }, clock.now());
            }
            // Counted with the start as stored: the answer or the close
            // takes that same value out. (The flag only pairs the two.)
            if flags.set(FLOW_F_PENDING_COUNTED) & FLOW_F_PENDING_COUNTED == 0 {
                // SAFETY: live map value.
                let (started, backend_id) = unsafe { ((*fwd).request_ns, (*fwd).backend_id) };
                progress::request_started(backend_id, started);
                // Late data of a closed connection: no close will come to
                // take it out again, so out at once (if the close did not
                // meanwhile: the flag's clear decides who).
                if flags.get() & FLOW_F_CLOSED != 0 {
                    pending_ended(fwd, flags);
                }
            }
            // The CPU that raised the request tells the reply entry, so the
            // backend's response looks the forward entry up for its sample
            // (one lookup per request here, none per reply packet there).
            // Forward first, then reply: the reply path clears them in the
            // opposite order (`reply_needs_state`).
            mirror_request_pending::<V6>(fwd, pkt);
        }
    }
    if pkt.has(TCP_RST) {
        close::<V6>(fwd, pkt, EVENT_CLOSED, CLOSE_RST, clock.now());
    } else if pkt.has(TCP_FIN) {
        fin::<V6>(fwd, pkt, FLOW_F_FIN_CLIENT, clock.now());
    }
}

/// Whether a packet of `entry` should compare the precise clock with its
/// `last_seen_ns` (the once-a-second refresh): only when
/// [`REFRESH_CHECK_JIFFIES`] passed since the last packet that did, which
/// this one then becomes. Jiffies cost a load, the precise clock a helper
/// call (see `helpers`). An entry written before `checked_jiffies` existed
/// holds 0 there: checked at its next packet.
#[inline(always)]
fn refresh_check_due(entry: *mut FlowEntry) -> bool {
    let j = jiffies();
    if check_waits_at(entry, j) {
        return false;
    }
    // SAFETY: live map value. `checked_jiffies` is the upper half of the
    // word whose lower half `Flags` updates with atomic read-modify-writes
    // that leave it unchanged, so this plain store and those updates keep
    // each other's bits; a racing CPU stores a similar value.
    unsafe { (*entry).checked_jiffies = j };
    true
}

/// Whether a packet of `entry` would skip the refresh check
/// ([`refresh_check_due`] false), without recording a check: the fast
/// path's test, which leaves a due check to the full path.
#[inline(always)]
pub fn refresh_check_waits(entry: *const FlowEntry) -> bool {
    check_waits_at(entry, jiffies())
}

/// Whether fewer than [`REFRESH_CHECK_JIFFIES`] passed between `entry`'s
/// last check and `j` (jiffies).
#[inline(always)]
fn check_waits_at(entry: *const FlowEntry, j: u32) -> bool {
    // SAFETY: live map value; a racing check stores a similar value.
    j.wrapping_sub(unsafe { (*entry).checked_jiffies }) < REFRESH_CHECK_JIFFIES
}

/// Sets `FLOW_F_REQUEST_PENDING` in the reply entry of the forward entry
/// `fwd` (a no-op if it has none).
#[inline(always)]
fn mirror_request_pending<const V6: bool>(fwd: *mut FlowEntry, pkt: &Packet) {
    if let Some(rev) = lookup::<V6>(&Translation::of(fwd).opposite_key(pkt)) {
        Flags::of(rev).set(FLOW_F_REQUEST_PENDING);
    }
}

/// Called first for each backend packet (not a later fragment) of the
/// reply entry `rev`: whether the once-a-second refresh is due. If so, its
/// `last_seen_ns` is refreshed now, the packet refreshes the forward
/// entry's (`backend_packet`), and its next hop is resolved again (which
/// picks up a changed neighbour, see `nexthop::forward_to_client`). A
/// closed reply entry keeps its close time (its SNAT tuple's quarantine):
/// for it the refresh is always due, so a closed connection's late packets
/// take the full path, as every reply packet did before the reply path
/// had a fast one. The precise clock is read (from `clock`) only when
/// jiffies say the check may be due (`refresh_check_due`).
#[inline(always)]
pub fn reply_refresh_due(rev: *mut FlowEntry, clock: &mut PacketClock) -> bool {
    if Flags::of(rev).get() & FLOW_F_CLOSED != 0 {
        return true;
    }
    if !refresh_check_due(rev) {
        return false;
    }
    let now = clock.now();
    // SAFETY: live map value; a racing refresh (or close) stores a similar
    // timestamp, so a torn race moves a quarantine start by nanoseconds.
    unsafe {
        if now.saturating_sub((*rev).last_seen_ns) > LAST_SEEN_GRANULARITY_NS {
            (*rev).last_seen_ns = now;
            return true;
        }
    }
    false
}

/// Whether the backend packet `pkt` of the reply entry `rev` needs the
/// connection state in the forward entry (beyond a due refresh): a SYN
/// (the SYN-ACK), FIN or RST, or a payload while a request is pending
/// (the latency sample). A payload takes the reply entry's pending bit
/// (an atomic clear, so of CPUs racing with responses only one looks the
/// forward entry up for the sample), before `backend_packet` clears the
/// forward entry's: a request raised in between finds the forward bit
/// still set and is not counted, as before. Called for every packet, also
/// one whose refresh is due, so that a payload that reaches the forward
/// entry always clears both bits. (The bits are two words, so a narrow
/// race remains: a request raised on another CPU between the mirror's two
/// steps and a response's two steps can be sampled early by that response
/// or go unsampled. Samples stay one per request at most.)
#[inline(always)]
pub fn reply_needs_state(pkt: &Packet, rev: *mut FlowEntry) -> bool {
    let flags = Flags::of(rev);
    let pending = pkt.payload_len > 0
        && flags.get() & FLOW_F_REQUEST_PENDING != 0
        && flags.clear(FLOW_F_REQUEST_PENDING) & FLOW_F_REQUEST_PENDING != 0;
    pending || pkt.has(TCP_SYN | TCP_FIN | TCP_RST)
}

/// A backend packet of the connection whose forward entry is `fwd`.
#[inline(always)]
pub fn backend_packet<const V6: bool>(pkt: &Packet, fwd: *mut FlowEntry, now: u64) {
    let flags = Flags::of(fwd);
    touch(fwd, flags, now);
    if pkt.has(TCP_SYN) && pkt.has(TCP_ACK) && flags.get() & FLOW_F_SYNACK_SEEN == 0 {
        flags.set(FLOW_F_SYNACK_SEEN);
        // SAFETY: live map value; a racing writer stores the same value.
        unsafe { (*fwd).state = FLOW_ESTABLISHED };
        // SAFETY: live map value; written only at creation.
        count_handshake(unsafe { (*fwd).backend_id });
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
        close::<V6>(fwd, pkt, kind, close_reason, now);
    } else if pkt.has(TCP_FIN) {
        fin::<V6>(fwd, pkt, FLOW_F_FIN_BACKEND, now);
    }
    if pkt.payload_len > 0 && flags.get() & FLOW_F_REQUEST_PENDING != 0 {
        // Out of the pending count first, while the pending bit still
        // keeps the client path from storing the next request's start.
        pending_ended(fwd, flags);
        let before = flags.clear(FLOW_F_REQUEST_PENDING);
        if before & FLOW_F_REQUEST_PENDING != 0 {
            // SAFETY: live map value.
            let (request_ns, backend_id) = unsafe { ((*fwd).request_ns, (*fwd).backend_id) };
            progress::answered(backend_id, now);
            record_latency(backend_id, now.saturating_sub(request_ns));
        }
    }
}

/// Counts a connection the backend accepted in this CPU's counter.
#[inline(always)]
fn count_handshake(backend_id: u32) {
    if let Some(count) = BACKEND_HANDSHAKES.get_ptr_mut(backend_id) {
        // SAFETY: this CPU's own copy of a per-CPU map value; XDP runs
        // with preemption off, so a plain increment loses nothing.
        unsafe { *count = (*count).wrapping_add(1) };
    }
}

/// Adds one latency sample to this CPU's aggregate for the backend: sum
/// and count, and the peak of the current epoch (see `lb_common::LatencyAgg`).
#[inline(always)]
fn record_latency(backend_id: u32, latency: u64) {
    let epoch = LATENCY_EPOCH.get(0).copied().unwrap_or(0);
    let Some(agg) = BACKEND_LATENCY.get_ptr_mut(backend_id) else {
        return;
    };
    // SAFETY: this CPU's own copy of a per-CPU map value; XDP runs with
    // preemption off, so a plain read-modify-write loses nothing.
    let agg = unsafe { &mut *agg };
    agg.sum_ns = agg.sum_ns.wrapping_add(latency);
    agg.count = agg.count.wrapping_add(1);
    if agg.peak_epoch != epoch {
        agg.peak_epoch = epoch;
        agg.peak_ns = latency;
    } else if latency > agg.peak_ns {
        agg.peak_ns = latency;
    }
}

/// A FIN from one side (`side` is its `FLOW_F_FIN_*` bit): the connection
/// closes when the other side's FIN is already there. The CPU whose
/// atomic OR completed the pair closes it.
#[inline(always)]
fn fin<const V6: bool>(fwd: *mut FlowEntry, pkt: &Packet, side: u32, now: u64) {
    let both = FLOW_F_FIN_CLIENT | FLOW_F_FIN_BACKEND;
    let flags = Flags::of(fwd);
    if flags.get() & side != 0 {
        return;
    }
    let before = flags.set(side);
    if before & side == 0 && (before | side) & both == both {
        close::<V6>(fwd, pkt, EVENT_CLOSED, CLOSE_FIN, now);
    } else {
        // SAFETY: live map value; informational only.
        unsafe { (*fwd).state = FLOW_CLOSING };
    }
}

/// Counts the connection closed, once: only the CPU that sets
/// `FLOW_F_CLOSED` advances `closed`, stamps both entries with the close
/// time and emits the event. The entries stay so late segments are still
/// translated (see the module documentation).
#[inline(always)]
fn close<const V6: bool>(fwd: *mut FlowEntry, pkt: &Packet, kind: u8, close_reason: u8, now: u64) {
    if !close_counted(fwd, now) {
        return;
    }
    stamp_closed(lookup::<V6>(&Translation::of(fwd).opposite_key(pkt)), now);
    // Only what needs a reaction goes to the ring: a refused connection or
    // a backend's reset. Ordinary closes are the `closed` counter.
    if kind == EVENT_REFUSED || close_reason == CLOSE_BACKEND_RST {
        // SAFETY: live map value.
        let (backend_id, vip_id) = unsafe { ((*fwd).backend_id, (*fwd).vip_id) };
        emit(kind, close_reason, backend_id, vip_id, now, 0);
    }
}

/// Takes the forward entry `fwd`'s request out of its backend's pending
/// count, if it is in it and this call is the one to clear the mark.
#[inline(always)]
fn pending_ended(fwd: *mut FlowEntry, flags: Flags) {
    if flags.get() & FLOW_F_PENDING_COUNTED != 0
        && flags.clear(FLOW_F_PENDING_COUNTED) & FLOW_F_PENDING_COUNTED != 0
    {
        // SAFETY: live map value; the start is not rewritten while the
        // request is pending.
        let (started, backend_id) = unsafe { ((*fwd).request_ns, (*fwd).backend_id) };
        progress::request_ended(backend_id, started);
    }
}

/// Marks the forward entry `fwd` closed at `now` and counts its backend's
/// `closed`, if this call was the one to set `FLOW_F_CLOSED`. A request
/// still pending leaves the backend's pending count.
#[inline(always)]
pub fn close_counted(fwd: *mut FlowEntry, now: u64) -> bool {
    if Flags::of(fwd).get() & FLOW_F_CLOSED != 0 {
        return false;
    }
    // The close time before the flag, as `flow::stamp_closed` orders them:
    // the sweep reads the flag, then the time, and a closed entry with its
    // open time (an idle connection's, older than the linger) would be
    // removed at once, under the packets still in flight. Never moved
    // back: a closer that loses the race below may be the sweep, whose
    // `now` is its pass's start.
    // SAFETY: live map value; aligned 8-byte loads and stores are one
    // instruction each.
    unsafe {
        let seen = &raw mut (*fwd).last_seen_ns;
        if seen.read_volatile() < now {
            seen.write_volatile(now);
        }
    }
    if Flags::of(fwd).set(FLOW_F_CLOSED) & FLOW_F_CLOSED != 0 {
        return false;
    }
    pending_ended(fwd, Flags::of(fwd));
    // SAFETY: live map value.
    let backend_id = unsafe {
        (*fwd).state = FLOW_CLOSING;
        (*fwd).backend_id
    };
    count_closed(backend_id);
    true
}

/// Counts one connection of backend `backend_id` closed (its `closed`, of
/// which `opened` less it is the backend's in-flight count).
#[inline(always)]
pub fn count_closed(backend_id: u32) {
    if let Some(conns) = BACKEND_CONNS.get_ptr_mut(backend_id) {
        // SAFETY: live, 8-byte aligned map value; every writer is atomic.
        unsafe { add_u64(&raw mut (*conns).closed, 1) };
    }
}

/// The key of the forward entry a reply entry (`key`, `reply`) belongs to.
#[inline(always)]
pub fn forward_key_of(key: &FlowKey, reply: *const FlowEntry) -> FlowKey {
    let t = Translation::of(reply);
    FlowKey::new(key.family, key.proto, t.dst, t.src, t.dport, t.sport)
}

/// Refreshes `last_seen_ns` when it is more than a granule old (and then
/// drops the cached next hop); a closed entry keeps its close time.
#[inline(always)]
fn touch(fwd: *mut FlowEntry, flags: Flags, now: u64) {
    if flags.get() & FLOW_F_CLOSED != 0 {
        return;
    }
    // SAFETY: live map value; a torn race only writes a similar timestamp.
    unsafe {
        if now.saturating_sub((*fwd).last_seen_ns) > LAST_SEEN_GRANULARITY_NS {
            (*fwd).last_seen_ns = now;
            // Drop the cached next hop (nexthop::forward_to_backend): the
            // next packet resolves it again.
            (&raw mut (*fwd).client_ifindex).write_volatile(0);
        }
    }
}
