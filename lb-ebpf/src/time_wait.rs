//! SNAT tuples taken over inside the backend's TIME_WAIT: the data path's
//! half of `lb_common::time_wait` (the rule and why it is safe are there).
//!
//! * The client's FIN records, in the connection's reply entry, what the
//!   backend's TIME_WAIT for the tuple will expect, or, after a close the
//!   client began, its last ACK does ([`record_client_close`]).
//! * A SYN may take over a closed tuple whose TIME_WAIT would accept it as
//!   sent: the one at its claim's cursor, or, when the claim found none
//!   free, one of the tuples its CPU handed out longest ago ([`take_over`]).
//!   The test of one tuple is `flow::may_take_over`; the SYN's sequence
//!   number and timestamp come from [`read_syn`].
use aya_ebpf::{bindings::xdp_md, programs::XdpContext};
use lb_common::{
    DIR_TO_BACKEND, FLOW_F_CLIENT_CLOSED_FIRST, FLOW_F_CLOSED, FLOW_F_FIN_BACKEND,
    FLOW_F_FIN_CLIENT, FLOW_F_TW_SEEN, FLOW_F_TW_TS, FLOW_F_TW_TS_UNKNOWN, FLOW_F_TW_UNACKED,
    FlowEntry, Reason, StageResult, Verdict, reason,
    time_wait::{OPTIONS_SEEN, TS_PRESENT, TS_UNKNOWN, TimeWaitView, TsOption, timestamp},
};

use crate::{
    atomic::Flags,
    flow::{Syn, Translation, TupleSource, lookup, past_second_quarantine},
    handover, helpers,
    maps::{CONFIG, Handover, PACKET_HANDOVER},
    packet::{Packet, load},
    select::Picked,
    wire::{TCP_ACK, TCP_DOFF_OFF, TCP_FIN, TCP_MIN_LEN, TCP_RST, TCP_SYN},
};

/// Offset of the sequence number in the TCP header.
const TCP_SEQ_OFF: usize = 4;

/// The TCP segment's sequence number (host byte order) and timestamp
/// option. Only the layouts `lb_common::time_wait::timestamp` knows are
/// told apart, from the first [`OPTIONS_SEEN`] bytes of options, read in
/// fixed sizes (a read of a variable length is one the verifier cannot
/// bound).
#[inline(always)]
pub fn seq_and_timestamp(ctx: &XdpContext, pkt: &Packet) -> Option<(u32, TsOption)> {
    let hdr: [u8; TCP_MIN_LEN] = load(ctx, pkt.l4)?;
    let seq = u32::from_be_bytes([
        hdr[TCP_SEQ_OFF],
        hdr[TCP_SEQ_OFF + 1],
        hdr[TCP_SEQ_OFF + 2],
        hdr[TCP_SEQ_OFF + 3],
    ]);
    let len = (usize::from(hdr[TCP_DOFF_OFF] >> 4) * 4).saturating_sub(TCP_MIN_LEN);
    let at = pkt.l4 + TCP_MIN_LEN;
    let mut opts = [0u8; OPTIONS_SEEN];
    if len >= 20 {
        opts = load::<[u8; 20]>(ctx, at)?;
    } else if len >= 16 {
        opts[..16].copy_from_slice(&load::<[u8; 16]>(ctx, at)?);
    } else if len >= 12 {
        opts[..12].copy_from_slice(&load::<[u8; 12]>(ctx, at)?);
    } else if len >= 8 {
        opts[..8].copy_from_slice(&load::<[u8; 8]>(ctx, at)?);
    } else if len >= 4 {
        opts[..4].copy_from_slice(&load::<[u8; 4]>(ctx, at)?);
    }
    Some((seq, timestamp(&opts, len)))
}

/// Puts `pkt` (and `picked`) in this CPU's handover slot, with the
/// segment's sequence number and timestamp (read by a global function of
/// their own, so that neither the caller's nor the next global function's
/// frame holds the option bytes: `lb_take_over`'s is near the stack limit).
#[inline(always)]
fn hand_over(ctx: &XdpContext, pkt: &Packet, picked: u32) -> bool {
    handover::put(pkt, picked) && lb_read_seq_and_timestamp(ctx.ctx) != 0
}

/// Reads the handover slot's segment's sequence number and timestamp into
/// the slot; 1 if it could. A global BPF function (verified once).
#[unsafe(no_mangle)]
#[inline(never)]
pub fn lb_read_seq_and_timestamp(ctx: *mut xdp_md) -> u64 {
    let ctx = XdpContext::new(ctx);
    let Some(slot) = PACKET_HANDOVER.get_ptr_mut(0) else {
        return 0;
    };
    // SAFETY: this CPU's own copy of a per-CPU map value.
    let pkt = unsafe { (*slot).pkt };
    if pkt.l4 >= handover::MAX_L4_OFFSET {
        return 0;
    }
    let Some((seq, ts)) = seq_and_timestamp(&ctx, &pkt) else {
        return 0;
    };
    // SAFETY: as above.
    unsafe {
        (*slot).seq = seq;
        (*slot).ts = ts;
    }
    1
}

/// Whether the client packet `pkt` of a forward entry whose flags are
/// `flags` is one [`record_client_close`] needs: a FIN, or any segment
/// with an ACK after the close (a pure ACK may be the client's last; a
/// late one with data only restarts the quarantine, as it restarts the
/// backend's TIME_WAIT).
#[inline(always)]
pub fn closes(pkt: &Packet, flags: u32) -> bool {
    pkt.is_tcp()
        && !pkt.has(TCP_RST | TCP_SYN)
        && (pkt.has(TCP_FIN) || (flags & FLOW_F_CLOSED != 0 && pkt.has(TCP_ACK)))
}

/// The client's close `pkt` (see [`closes`]) of a connection with a
/// forward entry: records in the connection's reply entry what the
/// backend's TIME_WAIT for the tuple will expect, from the client's last
/// segment. A FIN after the backend's is that segment (a retransmitted FIN
/// records again: Linux updates `ts_recent` from it); after a FIN before
/// the backend's, the client's last ACK is.
#[inline(always)]
pub fn record_client_close(ctx: &XdpContext, pkt: &Packet) {
    if hand_over(ctx, pkt, 0) {
        lb_record_client_close();
    }
}

/// [`record_client_close`]'s global BPF function: verified once, on its own
/// (as a static one, the option layouts were walked again for every
/// state of the forward path, about 77k instructions). Returns 0.
#[unsafe(no_mangle)]
#[inline(never)]
pub fn lb_record_client_close() -> u64 {
    let Some(&Handover { pkt, seq, ts, .. }) = handover::taken() else {
        return 0;
    };
    // The family becomes a constant of the code here, once.
    if pkt.is_v6() {
        record_close::<true>(&pkt, seq, ts);
    } else {
        record_close::<false>(&pkt, seq, ts);
    }
    0
}

/// [`lb_record_client_close`] for a packet of the family `V6` says.
#[inline(always)]
fn record_close<const V6: bool>(pkt: &Packet, seq: u32, ts: TsOption) {
    let Some(fwd) = lookup::<V6>(pkt.flow_key()) else {
        return;
    };
    let Some(rev) = lookup::<V6>(&Translation::of(fwd).opposite_key(pkt)) else {
        return;
    };
    // After a takeover the tuple's reply entry belongs to a newer
    // connection, of another client tuple: a late FIN of the old one must
    // not overwrite it.
    // SAFETY: live map values; written only when the entries are created.
    if unsafe {
        (*fwd).direction != DIR_TO_BACKEND
            || (*rev).new_dport != pkt.sport
            || (*rev).new_dst != pkt.saddr
    } {
        return;
    }
    // A segment of a closed connection that reaches the backend restarts
    // the TIME_WAIT it may hold the tuple in (Linux reschedules the
    // timewait timer for every segment with an ACK it gets there,
    // `tcp_timewait_state_process`), so the quarantine starts again with
    // it: the closed forward entry forwards such segments 10 s and more
    // after the close, past the 5 s of slack above the backend's 60 s.
    // Not past the second quarantine, when the tuple is the sweep's.
    if Flags::of(rev).get() & FLOW_F_CLOSED != 0
        && let Some(cfg) = CONFIG.get(0)
    {
        let now = helpers::now();
        // SAFETY: live map value; aligned 8-byte loads and stores are one
        // instruction each, and a later close time only holds the tuple
        // longer.
        let closed_at = unsafe { (&raw const (*rev).last_seen_ns).read_volatile() };
        if !past_second_quarantine(now.saturating_sub(closed_at), cfg.snat_quarantine_ns) {
            // SAFETY: as above.
            unsafe { (&raw mut (*rev).last_seen_ns).write_volatile(now) };
        }
    }
    let seen = Flags::of(fwd).get();
    let view = if pkt.has(TCP_FIN) {
        // Only a close the backend began ends in its TIME_WAIT with this
        // FIN the last segment from the client. This FIN has not set
        // `FLOW_F_FIN_CLIENT` yet (the forward path does, after this): the
        // client's first FIN came after the backend's, or a retransmission
        // of it finds the view its first one recorded.
        if seen & FLOW_F_FIN_BACKEND == 0 {
            // The client closes first: the backend goes through LAST_ACK
            // (where a SYN on the tuple draws a challenge ACK), and the
            // client's last ACK is recorded below.
            if seen & FLOW_F_FIN_CLIENT == 0 {
                Flags::of(fwd).set(FLOW_F_CLIENT_CLOSED_FIRST);
            }
            return;
        }
        if seen & FLOW_F_FIN_CLIENT != 0 && Flags::of(rev).get() & FLOW_F_TW_SEEN == 0 {
            return;
        }
        TimeWaitView::of_fin(seq, pkt.payload_len, ts)
    } else {
        // A pure ACK after the close: the client's last segment. After a
        // close the client began it ends the backend's LAST_ACK (no
        // TIME_WAIT), or, if the FINs crossed, it is the last segment the
        // backend's TIME_WAIT saw; after one the backend began, it can
        // only be later than the FIN recorded (the FINs crossed the other
        // way). Recording it covers all three.
        // A late segment with data (a retransmission) is not the
        // client's last: it only restarted the quarantine, above.
        if pkt.payload_len != 0
            || seen & FLOW_F_CLOSED == 0
            || (seen & FLOW_F_CLIENT_CLOSED_FIRST == 0
                && Flags::of(rev).get() & FLOW_F_TW_SEEN == 0)
        {
            return;
        }
        TimeWaitView::of_last_ack(seq, ts)
    };
    // The word first, then the flags that say it is there.
    // SAFETY: live map value; an aligned 8-byte store is one instruction.
    unsafe { (&raw mut (*rev).created_ns).write_volatile(view.packed()) };
    let flags = Flags::of(rev);
    let ts_flag = match ts.state {
        TS_PRESENT => FLOW_F_TW_TS,
        TS_UNKNOWN => FLOW_F_TW_TS_UNKNOWN,
        _ => 0,
    };
    // A FIN's view holds only once the backend acknowledges the FIN
    // ([`note_backend_ack`]): until then the backend may not have it. (A
    // last ACK draws no answer; the backend's answer to the client's FIN
    // came before it.)
    let unacked = if pkt.has(TCP_FIN) {
        FLOW_F_TW_UNACKED
    } else {
        0
    };
    flags.clear((FLOW_F_TW_TS | FLOW_F_TW_TS_UNKNOWN) & !ts_flag);
    flags.set(FLOW_F_TW_SEEN | ts_flag | unacked);
}

/// Offset of the acknowledgment number in the TCP header.
const TCP_ACK_SEQ_OFF: usize = 8;

/// A backend segment `pkt` of the closed reply entry `rev` whose view
/// still waits for the backend's answer ([`FLOW_F_TW_UNACKED`]): clears
/// the flag when the segment acknowledges exactly the view's `rcv_nxt`,
/// that is the client's FIN. Only then does the backend hold the tuple in
/// TIME_WAIT. Linux can lose a FIN that arrives while the socket it
/// closed turns from FIN_WAIT1 into a FIN_WAIT2 timewait socket
/// (`tcp_rcv_state_process`: "We still can lose it now"); the backend
/// then answers a SYN on the tuple with an ACK of the old connection, the
/// new client resets, and its SYN is sent again.
///
/// A BPF function of its own, reached only by a closed connection's reply
/// whose view waits (inside `reply_of_replaced`'s function it cost 3k more
/// verified instructions).
#[inline(never)]
pub fn note_backend_ack(ctx: &XdpContext, pkt: &Packet, rev: *mut FlowEntry) {
    if !pkt.has(TCP_ACK) || pkt.has(TCP_RST) || pkt.l4 >= handover::MAX_L4_OFFSET {
        return;
    }
    let Some(ack) = load::<[u8; 4]>(ctx, pkt.l4 + TCP_ACK_SEQ_OFF) else {
        return;
    };
    // SAFETY: live map value; the view is written before the flag that
    // says it is there, and this runs only with that flag set.
    let view = unsafe { (&raw const (*rev).created_ns).read_volatile() };
    if TimeWaitView::unpack(view, 0).rcv_nxt == u32::from_be_bytes(ack) {
        Flags::of(rev).clear(FLOW_F_TW_UNACKED);
    }
}

/// Reads the SYN in this CPU's handover slot (put there by the caller)
/// for a new flow's claim: its sequence number and timestamp go into the
/// slot; options it cannot read leave what `handover::put` wrote
/// ([`TsOption::UNKNOWN`]).
#[inline(always)]
pub fn read_syn(ctx: &XdpContext) {
    lb_read_seq_and_timestamp(ctx.ctx);
}

/// For a SYN that found no free SNAT tuple: creates the connection to the
/// backend the pick chose on a tuple in quarantine that the backend's
/// TIME_WAIT accepts the SYN on (`flow::take_over_tuple`). Continues, or
/// drops under a reason. The failed new flow left the SYN, the pick and
/// [`read_syn`]'s reading in this CPU's handover slot.
#[inline(always)]
pub fn take_over(ctx: &XdpContext) -> StageResult {
    StageResult::from_raw(lb_take_over(ctx.ctx))
}

/// [`take_over`]'s global BPF function: verified once, on its own (as a
/// static one it cost about 180k instructions, walked again for every
/// state of its caller).
#[unsafe(no_mangle)]
#[inline(never)]
pub fn lb_take_over(ctx: *mut xdp_md) -> u64 {
    let ctx = XdpContext::new(ctx);
    // The packet is used in place, not copied: this frame is near the
    // stack limit. (Its offsets are not used here: the options were read
    // by `lb_read_seq_and_timestamp`.)
    let Some(slot) = handover::taken() else {
        return StageResult::verdict(Verdict::drop(reason::DROP_BAD_CONFIG)).into_raw();
    };
    let syn = Syn {
        seq: slot.seq,
        ts: slot.ts,
    };
    let picked = Picked::from_payload(slot.picked);
    // The family becomes a constant of the code here, once.
    StageResult::continue_or_drop(if slot.pkt.is_v6() {
        try_take_over::<true>(&ctx, &slot.pkt, picked, syn)
    } else {
        try_take_over::<false>(&ctx, &slot.pkt, picked, syn)
    })
    .into_raw()
}

#[inline(always)]
fn try_take_over<const V6: bool>(
    ctx: &XdpContext,
    pkt: &Packet,
    picked: Picked,
    syn: Syn,
) -> Result<(), Reason> {
    let cfg = CONFIG.get(0).ok_or(reason::DROP_BAD_CONFIG)?;
    crate::create_flow::<V6>(ctx, pkt, cfg, picked, syn, TupleSource::TakeOver)
}
