//! The kernel sweep: idle expiry, SNAT quarantine and orphan cleanup, done
//! in the kernel so the control plane does no work proportional to the
//! flow table.
//!
//! `lb_sweep` is an XDP-typed program that is never attached: the control
//! plane runs it with `BPF_PROG_TEST_RUN` (one syscall) once a second. It
//! walks both flow tables (IPv6's `FLOWS`, IPv4's `FLOWS4`) with
//! `bpf_for_each_map_elem` (kernel ≥ 5.13) and decides for each entry:
//!
//! - forward entry, closed: removed `closed_linger_ns` after the close;
//! - forward entry, open: a SYN unanswered for `syn_timeout_ns` is closed as
//!   refused (a ring event), a flow idle past its protocol's timeout as
//!   idle (only counted), and so is a UDP flow whose backend is down by
//!   its health checks (see [`backend_down`]); a forward entry without its
//!   reply entry is an orphan. Each is counted closed, its reply stamped
//!   closed, and it is removed;
//! - reply entry, closed: removed, and its SNAT tuple freed, two
//!   `snat_quarantine_ns` after the close (the quarantine is the backend's
//!   TIME_WAIT plus slack, counted from the close; until the end of the
//!   second one a new flow whose claim reaches the tuple may take it over,
//!   see `flow::may_take_over`);
//! - reply entry, open, whose forward entry is gone or now belongs to
//!   another connection (a new SYN on the same client tuple): an orphan,
//!   counted closed and stamped closed now, so its tuple is freed after a
//!   quarantine.
//!
//! Idle expiry reads only the forward entry's `last_seen_ns`. The reply
//! path refreshes it at most once a second per flow, when the reply
//! entry's own `last_seen_ns` (its once-a-second stamp while open, read
//! by nothing here) is due (`track::reply_refresh_due`), so it lags a
//! backend's last packet by under two seconds, far below any idle timeout.
//!
//! A light pass (the frame's first byte is `SWEEP_LIGHT`) skips the pair
//! checks: an open entry's other direction is looked up only to close the
//! flow, so lone entries are found by full passes only. The lookups are
//! most of a pass's cost on a large table; the control plane runs a full
//! pass every few (see lb-user's `ingest::reconcile`).
//!
//! Both entries of a connection therefore leave together or the reply
//! entry outlives its forward entry only as a stamped quarantine holder.
//! Deleting the element the walk stands on is allowed: the hash walk holds
//! only RCU, not the bucket lock, and preallocated elements stay valid
//! memory; an element moved by a concurrent insert may be skipped, and the
//! next sweep sees it.
#![allow(
    clippy::needless_borrows_for_generic_args,
    reason = "40-byte keys are passed by reference; by value each would be copied again on the stack"
)]

use core::ffi::c_void;

use aya_ebpf::{
    bindings::xdp_action, helpers::generated::bpf_for_each_map_elem, macros::xdp,
    programs::XdpContext,
};
use lb_common::{
    BACKEND_DOWN, DIR_TO_CLIENT, EVENT_REFUSED, FLOW_F_CLOSED, FLOW_F_SYNACK_SEEN, FLOW_F_TAKEN,
    FLOW_F_TW_SEEN, FlowEntry, FlowKey, FlowKeyV4, IPPROTO_TCP, IPPROTO_UDP, SWEEP_LIGHT,
    SweepStats,
};

use crate::{
    atomic::Flags,
    events::emit,
    flow::{
        Translation, lookup_on_stack, past_second_quarantine, remove_on_stack, snat_used,
        stamp_closed,
    },
    helpers::now,
    maps::{BACKENDS, CONFIG, FLOWS, FLOWS4, SWEEP_STATS},
    track::{close_counted, count_closed, forward_key_of},
};

/// The walk's inputs and tallies, shared with the callback.
#[repr(C)]
struct Walk {
    /// Whether open entries are checked against their other direction
    /// (a full pass); a light pass looks it up only to close a flow.
    check_pairs: bool,
    now: u64,
    tcp_idle_ns: u64,
    udp_idle_ns: u64,
    syn_timeout_ns: u64,
    closed_linger_ns: u64,
    snat_quarantine_ns: u64,
    stats: SweepStats,
}

#[xdp]
pub fn lb_sweep(ctx: XdpContext) -> u32 {
    // The frame's first byte says which pass (`SWEEP_LIGHT`); bounds
    // checked, and a frame too short for it asks for a full pass.
    let light = first_byte(&ctx) == Some(SWEEP_LIGHT);
    let Some(cfg) = CONFIG.get(0) else {
        return xdp_action::XDP_ABORTED;
    };
    let Some(stats) = SWEEP_STATS.get_ptr_mut(0) else {
        return xdp_action::XDP_ABORTED;
    };
    let mut walk = Walk {
        check_pairs: !light,
        now: now(),
        tcp_idle_ns: cfg.tcp_idle_ns,
        udp_idle_ns: cfg.udp_idle_ns,
        syn_timeout_ns: cfg.syn_timeout_ns,
        closed_linger_ns: cfg.closed_linger_ns,
        snat_quarantine_ns: cfg.snat_quarantine_ns,
        // SAFETY: live map value; only this program writes it, one run at a time.
        stats: unsafe { *stats },
    };
    // SAFETY: the map pointer is the map's own symbol (aya-ebpf's map types
    // are `repr(transparent)` over the definition the loader relocates);
    // `visit` has the callback signature the helper expects and only
    // touches `walk`, which outlives the call.
    let (entries, entries4) = unsafe {
        (
            bpf_for_each_map_elem(
                (&raw const FLOWS).cast_mut().cast::<c_void>(),
                visit as *mut c_void,
                (&raw mut walk).cast::<c_void>(),
                0,
            ),
            bpf_for_each_map_elem(
                (&raw const FLOWS4).cast_mut().cast::<c_void>(),
                visit4 as *mut c_void,
                (&raw mut walk).cast::<c_void>(),
                0,
            ),
        )
    };
    walk.stats.entries = entries.max(0) as u64 + entries4.max(0) as u64;
    walk.stats.runs += 1;
    walk.stats.last_run_ns = walk.now;
    // SAFETY: as above.
    unsafe { *stats = walk.stats };
    xdp_action::XDP_PASS
}

/// The frame's first byte, if it has eight (the control plane's frames
/// have 64). Read as a word: with a one-byte check LLVM emits
/// `start >= end`, a form the verifier does not follow.
#[inline(always)]
fn first_byte(ctx: &XdpContext) -> Option<u8> {
    crate::packet::load::<[u8; 8]>(ctx, 0).map(|word| word[0])
}

/// One entry of `FLOWS`' walk; returns 0 to go on.
extern "C" fn visit(
    _map: *mut c_void,
    key: *mut FlowKey,
    entry: *mut FlowEntry,
    ctx: *mut c_void,
) -> i64 {
    // SAFETY: the helper passes back the pointer `lb_sweep` gave it, and
    // the element's key and value.
    let (walk, key) = unsafe { (&mut *ctx.cast::<Walk>(), *key) };
    visit_entry::<true>(walk, &key, entry)
}

/// One entry of `FLOWS4`' walk (IPv4's table); returns 0 to go on.
extern "C" fn visit4(
    _map: *mut c_void,
    key: *mut FlowKeyV4,
    entry: *mut FlowEntry,
    ctx: *mut c_void,
) -> i64 {
    // SAFETY: as in `visit`.
    let (walk, key) = unsafe { (&mut *ctx.cast::<Walk>(), (*key).widen()) };
    visit_entry::<false>(walk, &key, entry)
}

/// The decision for one entry, `key`, of the table `V6` names (IPv6's
/// `FLOWS` or IPv4's `FLOWS4`, see `flow::lookup`); its other direction is
/// in the same table. Returns 0 to go on.
#[inline(always)]
fn visit_entry<const V6: bool>(walk: &mut Walk, key: &FlowKey, entry: *mut FlowEntry) -> i64 {
    let key = *key;
    // The flags first: a close writes its time before the flag that
    // publishes it (`track::stamp_closed`), so a closed entry read in this
    // order never shows its open time as its close time (read the other
    // way round, a stale open time could free a tuple without quarantine).
    let closed = Flags::of(entry).get() & FLOW_F_CLOSED != 0;
    // SAFETY: live map value.
    let (direction, created, last_seen) = unsafe {
        (
            (*entry).direction,
            (*entry).created_ns,
            (&raw const (*entry).last_seen_ns).read_volatile(),
        )
    };
    let age = walk.now.saturating_sub(last_seen);
    if direction == DIR_TO_CLIENT {
        if closed {
            // Until two quarantines are over the tuple belongs to the data
            // path (`flow::may_take_over`); after that, to the sweep. Never
            // both: the sweep removes by key, so two deciders on one entry
            // could free a tuple twice, or remove the new connection's
            // entry written under the key.
            if past_second_quarantine(age, walk.snat_quarantine_ns) {
                // SAFETY: live map value.
                let backend_id = unsafe { (*entry).backend_id };
                // Claimed first, like every free of a closed tuple (a
                // SYN may be taking it over: `time_wait::may_take_over`).
                if claim_closed(entry, created) && remove_on_stack::<V6>(&key) {
                    snat_used(backend_id, u64::MAX);
                    walk.stats.removed += 1;
                    walk.stats.snat_freed += 1;
                }
            }
        } else if walk.check_pairs
            && !being_created(walk, entry, created)
            && !forward_points_back::<V6>(&key, entry)
        {
            // Every way a forward entry leaves the table counts its
            // connection closed and stamps this entry first; an open one
            // left alone lost its forward entry uncounted, and would hold
            // its backend's in-flight count (and its id) up for good.
            if Flags::of(entry).get() & FLOW_F_CLOSED == 0 {
                // SAFETY: live map value.
                count_closed(unsafe { (*entry).backend_id });
            }
            stamp_closed(Some(entry), walk.now);
            walk.stats.orphans += 1;
        }
        return 0;
    }
    if closed {
        // Claimed first, as a SYN that replaces the entry claims it (see
        // `flow::insert_forward`): removed by key, the new connection's
        // entry written meanwhile would go instead.
        if age > walk.closed_linger_ns
            && claim_closed(entry, created)
            && remove_on_stack::<V6>(&key)
        {
            walk.stats.removed += 1;
        }
        return 0;
    }
    let flags = Flags::of(entry).get();
    let syn_expired = key.proto == IPPROTO_TCP
        && flags & FLOW_F_SYNACK_SEEN == 0
        && walk.now.saturating_sub(created) > walk.syn_timeout_ns;
    let idle_expired = if key.proto == IPPROTO_UDP {
        age > walk.udp_idle_ns || backend_down(unsafe { (*entry).backend_id })
    } else {
        age > walk.tcp_idle_ns
    };
    // A live flow in a light pass: no lookup (most of a pass's cost on a
    // large table is these lookups).
    if !walk.check_pairs && !syn_expired && !idle_expired {
        return 0;
    }
    let reply_key = Translation::of(entry).opposite_key_of(&key);
    let reply = lookup_on_stack::<V6>(&reply_key);
    // (event kind, close reason); kind 0: none. Plain integers rather than
    // an `Option` of a tuple: LLVM copied the `None` case's undefined
    // payload register, a read the verifier rejects (`R5 !read_ok`).
    let (kind, close_reason) = if reply.is_none() {
        walk.stats.orphans += 1;
        (0, 0)
    } else if syn_expired {
        walk.stats.expired_syn += 1;
        (EVENT_REFUSED, 0)
    } else if idle_expired {
        walk.stats.expired_idle += 1;
        // Counted closed; no event (nothing to react to).
        (0, 0)
    } else {
        return 0;
    };
    // Its element may have been reused by another key's update since (see
    // `claim_closed`): closing it would close that connection. A later
    // pass judges this key again.
    if !still_created_at(entry, created) {
        return 0;
    }
    if close_counted(entry, walk.now) {
        stamp_closed(reply, walk.now);
        if kind != 0 {
            // SAFETY: live map value.
            let (backend_id, vip_id) = unsafe { ((*entry).backend_id, (*entry).vip_id) };
            emit(kind, close_reason, backend_id, vip_id, walk.now, 0);
        }
    }
    // Closed now, by this pass or by a SYN that may be replacing it:
    // removed only by whoever claims it (as above).
    if claim_closed(entry, created) && remove_on_stack::<V6>(&key) {
        walk.stats.removed += 1;
    }
    0
}

/// Whether backend `id` is down by its health checks. A UDP flow on it
/// is closed as if idle: a sender with a fixed port (syslog, RADIUS, SIP)
/// never goes quiet, so its flow would stay on the dead backend for good,
/// where a TCP client reconnects from another port. Its next datagram is
/// balanced again. A UDP flow on a draining backend is kept (a drain lets
/// flows finish), and so is one on an ejected backend (perhaps only slow,
/// where a session protocol such as QUIC keeps its state at the backend),
/// and every TCP flow (moved, it would only be reset).
#[inline(always)]
fn backend_down(id: u32) -> bool {
    BACKENDS.get(id).is_some_and(|b| b.state == BACKEND_DOWN)
}

/// Claims the closed forward entry `entry` for removal ([`FLOW_F_TAKEN`]);
/// false if a SYN replacing it (or an earlier pass) has, or if the
/// element no longer holds the closed entry this visit read (`created`,
/// its `created_ns` then).
///
/// The flow tables are preallocated hashes: an update that replaces a key's
/// entry (a SYN on a closed tuple) parks the old element as its CPU's spare,
/// and that CPU's next such update writes a new entry into it at once, with
/// no grace period. Between this visit's first read and its claim, the
/// element may so have become another key's live entry; claimed, the
/// removal by this visit's key would then take the newer connection's
/// entry, and the claim would stick to the other one. A live entry is not
/// closed, and a new one was created at another time: either undoes the
/// claim, and a later pass judges the key again.
#[inline(always)]
fn claim_closed(entry: *mut FlowEntry, created: u64) -> bool {
    let before = Flags::of(entry).set(FLOW_F_TAKEN);
    if before & FLOW_F_TAKEN != 0 {
        return false;
    }
    if before & FLOW_F_CLOSED != 0 && still_created_at(entry, created) {
        return true;
    }
    Flags::of(entry).clear(FLOW_F_TAKEN);
    false
}

/// Whether the element `entry` still holds the entry this visit read, by
/// its creation time `created` (see [`claim_closed`]).
#[inline(always)]
fn still_created_at(entry: *const FlowEntry, created: u64) -> bool {
    // SAFETY: live map value (an element of the table, reused or not); an
    // aligned 8-byte load is one instruction.
    unsafe { (&raw const (*entry).created_ns).read_volatile() == created }
}

/// Whether the open reply entry `reply`, created at `created`, may belong
/// to a connection another CPU is creating right now: `flow::create`
/// inserts the reply entry (the SNAT claim) before the forward one, so
/// between the two the reply entry stands alone. Judged lone then, it
/// would be stamped closed under a live connection, its tuple later taken
/// over or freed. Such entries wait for a later pass ([`LONE_REPLY_GRACE_NS`]).
/// A reply entry's `created_ns` holds the backend's TIME_WAIT view once
/// [`FLOW_F_TW_SEEN`] is set (after the client's FIN): never new then.
#[inline(always)]
fn being_created(walk: &Walk, reply: *mut FlowEntry, created: u64) -> bool {
    Flags::of(reply).get() & FLOW_F_TW_SEEN == 0
        && walk.now.saturating_sub(created) < LONE_REPLY_GRACE_NS
}

/// How old a reply entry must be before a full pass may judge it lone:
/// far longer than the few hundred nanoseconds between a new connection's
/// two inserts, shorter than a full pass's interval.
const LONE_REPLY_GRACE_NS: u64 = 1_000_000_000;

/// Whether the reply entry (`key`, `reply`) is still the one its forward
/// entry translates to: the forward entry exists and its rewrite is this
/// entry's key reversed (same SNAT tuple, same backend).
#[inline(always)]
fn forward_points_back<const V6: bool>(key: &FlowKey, reply: *const FlowEntry) -> bool {
    let Some(fwd) = lookup_on_stack::<V6>(&forward_key_of(key, reply)) else {
        return false;
    };
    let t = Translation::of(fwd);
    t.src == key.dst && t.sport == key.dport && t.dst == key.src && t.dport == key.sport
}
