//! Reusing a SNAT tuple inside the backend's TIME_WAIT, safely.
//!
//! A closed connection's SNAT tuple is quarantined (`snat_quarantine`,
//! 65 s) because the backend may hold it in TIME_WAIT: a SYN on it that
//! the backend does not take for a new connection is answered with an ACK
//! of the old one, the client resets, and its SYN is retransmitted a
//! second or more later (the 1 s tail). The quarantine caps new
//! connections per backend at addresses × ports ÷ quarantine.
//!
//! But a host in TIME_WAIT does take a new SYN on the tuple when it can
//! tell it from an old duplicate (RFC 6191; Linux's
//! `tcp_timewait_state_process`, FreeBSD's `tcp_twcheck`): when the SYN's
//! timestamp is newer than the last one the old connection carried, or,
//! without timestamps, when its sequence number is beyond the old
//! connection's last one. The data path records what the backend's
//! TIME_WAIT holds, from the client's FIN (the last segment the backend
//! got from that peer: `rcv_nxt` = FIN sequence + data + 1, and the FIN's
//! timestamp), and a new SYN may take over a tuple still in quarantine
//! when [`accepts_syn`] says the backend would take it, and, for a view
//! from a FIN, once the backend has acknowledged that FIN
//! ([`crate::FLOW_F_TW_UNACKED`]: a backend that lost the FIN is in
//! FIN_WAIT2, not TIME_WAIT). (After a close
//! the client began, its last ACK is recorded instead: the backend then
//! holds no TIME_WAIT, or, if the two FINs crossed, one whose last
//! segment from the client was that ACK.) Nothing is
//! rewritten: the check picks, among the tuples in quarantine, one the
//! SYN as sent is acceptable on. Clients pick a random timestamp offset
//! and initial sequence number per connection, so about half the tuples
//! qualify for a given SYN: the claim takes the tuple at its cursor when it
//! qualifies, and a claim that found no free tuple tries
//! [`crate::SNAT_REUSE_TRIES`] of them.
//!
//! Where the options are not in a layout this module knows, the answer is
//! [`TS_UNKNOWN`] and the tuple stays in quarantine: a wrong guess would
//! bring back the SYN retransmit this exists to avoid.

/// Bytes of TCP options the data path copies to look for a timestamp:
/// enough for every layout [`timestamp`] knows.
pub const OPTIONS_SEEN: usize = 20;

/// [`TsOption::state`]: the segment has no timestamp option.
pub const TS_ABSENT: u8 = 0;
/// It has one; [`TsOption::value`] is its TSval.
pub const TS_PRESENT: u8 = 1;
/// Its options are in a layout [`timestamp`] does not know: it may have one.
pub const TS_UNKNOWN: u8 = 2;

/// What a segment's options say about the timestamp (plain integers, not
/// an enum with a payload: the data path passes it between functions).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TsOption {
    pub state: u8,
    /// TSval, host byte order (valid for [`TS_PRESENT`]).
    pub value: u32,
}

impl TsOption {
    pub const ABSENT: Self = Self {
        state: TS_ABSENT,
        value: 0,
    };
    pub const UNKNOWN: Self = Self {
        state: TS_UNKNOWN,
        value: 0,
    };

    #[inline(always)]
    pub const fn present(value: u32) -> Self {
        Self {
            state: TS_PRESENT,
            value,
        }
    }
}

const NOP: u8 = 1;
const MSS: u8 = 2;
const WSCALE: u8 = 3;
const SACK_PERM: u8 = 4;
const TIMESTAMP: u8 = 8;
const TIMESTAMP_LEN: u8 = 10;

/// The timestamp option among the first `len` bytes of a segment's options
/// (`opts` holds at most [`OPTIONS_SEEN`] of them, zero beyond). Knows the
/// layouts that Linux, FreeBSD/macOS and Windows send:
/// * no options: absent;
/// * `NOP NOP TS` first (Linux and BSD after the handshake);
/// * a SYN: `MSS`, then `SACK_PERM TS` or `NOP NOP TS` (Linux), or
///   `NOP WS NOP NOP TS` (BSD, macOS);
/// * a SYN without timestamps: `MSS NOP WS` (then nothing, or `NOP NOP
///   SACK_PERM`, Windows), `MSS NOP NOP SACK_PERM NOP WS` (Linux with
///   timestamps off).
///
/// Anything else is [`TS_UNKNOWN`].
#[inline(always)]
pub fn timestamp(opts: &[u8; OPTIONS_SEEN], len: usize) -> TsOption {
    let ts_at = |at: usize| {
        TsOption::present(u32::from_be_bytes([
            opts[at],
            opts[at + 1],
            opts[at + 2],
            opts[at + 3],
        ]))
    };
    if len == 0 {
        return TsOption::ABSENT;
    }
    if len >= 12 && opts[0] == NOP && opts[1] == NOP && is_ts(opts[2], opts[3]) {
        return ts_at(4);
    }
    if len < 4 || opts[0] != MSS || opts[1] != 4 {
        return TsOption::UNKNOWN;
    }
    // After the MSS option.
    if len >= 16
        && ((opts[4] == SACK_PERM && opts[5] == 2) || (opts[4] == NOP && opts[5] == NOP))
        && is_ts(opts[6], opts[7])
    {
        return ts_at(8);
    }
    let window_scale = opts[4] == NOP && opts[5] == WSCALE && opts[6] == 3;
    if window_scale && len >= 20 && opts[8] == NOP && opts[9] == NOP && is_ts(opts[10], opts[11]) {
        return ts_at(12);
    }
    if window_scale
        && (len == 8
            || (len == 12 && opts[8] == NOP && opts[9] == NOP && is_sack_perm(opts[10], opts[11])))
    {
        return TsOption::ABSENT;
    }
    if len == 12
        && opts[4] == NOP
        && opts[5] == NOP
        && is_sack_perm(opts[6], opts[7])
        && opts[8] == NOP
        && opts[9] == WSCALE
        && opts[10] == 3
    {
        return TsOption::ABSENT;
    }
    TsOption::UNKNOWN
}

#[inline(always)]
const fn is_ts(kind: u8, len: u8) -> bool {
    kind == TIMESTAMP && len == TIMESTAMP_LEN
}

#[inline(always)]
const fn is_sack_perm(kind: u8, len: u8) -> bool {
    kind == SACK_PERM && len == 2
}

/// What the backend's TIME_WAIT for a tuple holds, as recorded from the
/// client's FIN: the next sequence number it expects and, if the
/// connection used timestamps, the last TSval it saw.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TimeWaitView {
    pub rcv_nxt: u32,
    pub ts_recent: TsOption,
}

impl TimeWaitView {
    /// From the client's FIN: its sequence number, data bytes and options.
    #[inline(always)]
    pub const fn of_fin(seq: u32, data_len: u32, ts: TsOption) -> Self {
        Self {
            rcv_nxt: seq.wrapping_add(data_len).wrapping_add(1),
            ts_recent: ts,
        }
    }

    /// From the client's last ACK, after its FIN (no data): its sequence
    /// number is the next one the backend expects.
    #[inline(always)]
    pub const fn of_last_ack(seq: u32, ts: TsOption) -> Self {
        Self {
            rcv_nxt: seq,
            ts_recent: ts,
        }
    }

    /// Packed into one word (the reply entry's `created_ns`, see
    /// [`crate::FlowEntry`]): `rcv_nxt` high, TSval low; the timestamp's
    /// state goes in the entry's flags.
    #[inline(always)]
    pub const fn packed(&self) -> u64 {
        ((self.rcv_nxt as u64) << 32) | self.ts_recent.value as u64
    }

    #[inline(always)]
    pub const fn unpack(word: u64, ts_state: u8) -> Self {
        Self {
            rcv_nxt: (word >> 32) as u32,
            ts_recent: TsOption {
                state: ts_state,
                value: word as u32,
            },
        }
    }
}

/// Whether a host holding the tuple in TIME_WAIT as `tw` describes takes
/// a SYN with sequence number `seq` and timestamp `ts` for a new
/// connection (Linux's rule, RFC 6191's in substance):
/// * the old connection used timestamps and the SYN carries one: PAWS must
///   not reject it (TSval at least `ts_recent`), and then either the TSval
///   is newer or the sequence number is beyond `rcv_nxt`;
/// * otherwise (no timestamps on one side; Linux parses none when the old
///   connection had none): the sequence number is beyond `rcv_nxt`.
///
/// An unknown option layout on either side answers no.
#[inline(always)]
pub const fn accepts_syn(tw: &TimeWaitView, seq: u32, ts: TsOption) -> bool {
    let seq_after = (seq.wrapping_sub(tw.rcv_nxt) as i32) > 0;
    match (tw.ts_recent.state, ts.state) {
        (TS_UNKNOWN, TS_ABSENT) | (TS_ABSENT, TS_ABSENT | TS_PRESENT) | (TS_PRESENT, TS_ABSENT) => {
            seq_after
        }
        (TS_PRESENT, TS_PRESENT) => {
            // `tcp_paws_reject` checks with a window of 0 here: a TSval
            // behind `ts_recent` at all is rejected.
            let behind = tw.ts_recent.value.wrapping_sub(ts.value) as i32;
            behind <= 0 && (behind < 0 || seq_after)
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(bytes: &[u8]) -> ([u8; OPTIONS_SEEN], usize) {
        let mut buf = [0u8; OPTIONS_SEEN];
        let n = bytes.len().min(OPTIONS_SEEN);
        buf[..n].copy_from_slice(&bytes[..n]);
        (buf, bytes.len())
    }

    fn ts_of(bytes: &[u8]) -> TsOption {
        let (buf, len) = opts(bytes);
        timestamp(&buf, len)
    }

    const TSVAL: [u8; 4] = [0x12, 0x34, 0x56, 0x78];

    #[test]
    fn finds_the_timestamp_in_the_layouts_hosts_send() {
        // Linux SYN: MSS, SACK_PERM, TS, NOP, WS.
        let linux_syn = [
            2, 4, 5, 180, 4, 2, 8, 10, 0x12, 0x34, 0x56, 0x78, 0, 0, 0, 0, 1, 3, 3, 7,
        ];
        assert_eq!(ts_of(&linux_syn), TsOption::present(0x1234_5678));
        // Linux SYN with SACK off: MSS, NOP, NOP, TS, NOP, WS.
        let mut no_sack = linux_syn;
        no_sack[4] = 1;
        no_sack[5] = 1;
        assert_eq!(ts_of(&no_sack), TsOption::present(0x1234_5678));
        // BSD/macOS SYN: MSS, NOP, WS, NOP, NOP, TS, SACK_PERM, EOL (24
        // bytes; the first 20 are seen).
        let mut bsd = vec![2, 4, 5, 180, 1, 3, 3, 6, 1, 1, 8, 10];
        bsd.extend_from_slice(&TSVAL);
        bsd.extend_from_slice(&[0, 0, 0, 0, 4, 2, 0, 0]);
        assert_eq!(ts_of(&bsd), TsOption::present(0x1234_5678));
        // Any segment after the handshake: NOP, NOP, TS.
        let mut segment = vec![1, 1, 8, 10];
        segment.extend_from_slice(&TSVAL);
        segment.extend_from_slice(&[0, 0, 0, 1]);
        assert_eq!(ts_of(&segment), TsOption::present(0x1234_5678));
        // The same followed by SACK blocks (beyond the bytes seen).
        segment.extend_from_slice(&[1, 1, 5, 10, 0, 0, 0, 1, 0, 0, 0, 2]);
        assert_eq!(ts_of(&segment), TsOption::present(0x1234_5678));
    }

    #[test]
    fn knows_syns_without_timestamps() {
        assert_eq!(ts_of(&[]), TsOption::ABSENT);
        // MSS, NOP, WS.
        assert_eq!(ts_of(&[2, 4, 5, 180, 1, 3, 3, 8]), TsOption::ABSENT);
        // Windows: MSS, NOP, WS, NOP, NOP, SACK_PERM.
        assert_eq!(
            ts_of(&[2, 4, 5, 180, 1, 3, 3, 8, 1, 1, 4, 2]),
            TsOption::ABSENT
        );
        // Linux with timestamps off: MSS, NOP, NOP, SACK_PERM, NOP, WS.
        assert_eq!(
            ts_of(&[2, 4, 5, 180, 1, 1, 4, 2, 1, 3, 3, 7]),
            TsOption::ABSENT
        );
    }

    #[test]
    fn an_unknown_layout_is_unknown_not_absent() {
        // MSS only: unusual; may be followed by anything.
        assert_eq!(ts_of(&[2, 4, 5, 180]), TsOption::UNKNOWN);
        // TS first, without the NOPs.
        let mut bare = vec![8, 10];
        bare.extend_from_slice(&TSVAL);
        bare.extend_from_slice(&[0, 0, 0, 0, 1, 1]);
        assert_eq!(ts_of(&bare), TsOption::UNKNOWN);
        // SACK blocks alone (a non-SYN without timestamps).
        assert_eq!(
            ts_of(&[1, 1, 5, 10, 0, 0, 0, 1, 0, 0, 0, 2]),
            TsOption::UNKNOWN
        );
        // A truncated timestamp: NOP NOP TS with 8 bytes in all.
        assert_eq!(ts_of(&[1, 1, 8, 10, 0, 0, 0, 1]), TsOption::UNKNOWN);
        // Options longer than the MSS layouts (a BSD SYN cut at 16).
        assert_eq!(
            ts_of(&[2, 4, 5, 180, 1, 3, 3, 6, 1, 1, 8, 10, 0, 0, 0, 1]),
            TsOption::UNKNOWN
        );
    }

    fn tw(rcv_nxt: u32, ts: TsOption) -> TimeWaitView {
        TimeWaitView {
            rcv_nxt,
            ts_recent: ts,
        }
    }

    #[test]
    fn with_timestamps_on_both_sides_a_newer_tsval_is_taken_whatever_the_sequence() {
        let old = tw(1_000, TsOption::present(500));
        assert!(accepts_syn(&old, 10, TsOption::present(501)));
        assert!(accepts_syn(&old, 2_000, TsOption::present(501)));
        // Equal: PAWS lets it through, the sequence decides.
        assert!(!accepts_syn(&old, 10, TsOption::present(500)));
        assert!(accepts_syn(&old, 2_000, TsOption::present(500)));
        // Behind: PAWS rejects it (`PAWSTimewait`), sequence or not.
        assert!(!accepts_syn(&old, 2_000, TsOption::present(499)));
        assert!(!accepts_syn(&old, 2_000, TsOption::present(498)));
        // TSvals wrap.
        let wrapped = tw(1_000, TsOption::present(u32::MAX - 1));
        assert!(accepts_syn(&wrapped, 10, TsOption::present(3)));
    }

    #[test]
    fn without_timestamps_the_sequence_number_decides() {
        for (old_ts, syn_ts) in [
            (TsOption::ABSENT, TsOption::ABSENT),
            (TsOption::ABSENT, TsOption::present(7)),
            (TsOption::present(9), TsOption::ABSENT),
            (TsOption::UNKNOWN, TsOption::ABSENT),
        ] {
            let old = tw(1_000, old_ts);
            assert!(accepts_syn(&old, 1_001, syn_ts), "{old_ts:?} {syn_ts:?}");
            assert!(!accepts_syn(&old, 1_000, syn_ts), "{old_ts:?} {syn_ts:?}");
            assert!(!accepts_syn(&old, 999, syn_ts), "{old_ts:?} {syn_ts:?}");
            // Sequence numbers wrap: "after" is within 2^31.
            let near_wrap = tw(u32::MAX - 5, old_ts);
            assert!(accepts_syn(&near_wrap, 5, syn_ts));
            assert!(!accepts_syn(&tw(5, old_ts), 5 + (1 << 31), syn_ts));
        }
    }

    #[test]
    fn an_unknown_layout_on_either_side_keeps_the_quarantine() {
        let old = tw(1_000, TsOption::UNKNOWN);
        assert!(!accepts_syn(&old, 2_000, TsOption::present(1)));
        assert!(!accepts_syn(&old, 2_000, TsOption::UNKNOWN));
        let known = tw(1_000, TsOption::present(1));
        assert!(!accepts_syn(&known, 2_000, TsOption::UNKNOWN));
        assert!(!accepts_syn(
            &tw(1_000, TsOption::ABSENT),
            2_000,
            TsOption::UNKNOWN
        ));
    }

    #[test]
    fn the_view_of_a_fin_and_its_packing() {
        let view = TimeWaitView::of_fin(u32::MAX, 0, TsOption::present(77));
        assert_eq!(view.rcv_nxt, 0);
        let view = TimeWaitView::of_fin(100, 20, TsOption::present(77));
        assert_eq!(view.rcv_nxt, 121);
        assert_eq!(
            TimeWaitView::of_last_ack(121, TsOption::present(78)).rcv_nxt,
            121
        );
        assert_eq!(TimeWaitView::unpack(view.packed(), TS_PRESENT), view);
    }
}
