//! Incremental Internet checksum updates (RFC 1624, eqn. 3: `HC' = ~(~HC + ~m + m')`).
//!
//! Only fixed-size fields change (addresses and ports), so the update is a
//! handful of 16-bit additions; a variable-length `bpf_csum_diff` is rejected
//! by the verifier for Rust programs (aya #1562) and is not needed.
//!
//! The one's complement sum is independent of byte order (RFC 1071 §2(B)),
//! so words are added exactly as loaded from the packet, without swapping,
//! and the result is stored the same way.

/// Accumulated `~m + m'` over the 16-bit words that change.
#[derive(Clone, Copy, Default)]
pub struct CsumDelta(u32);

impl CsumDelta {
    /// Accounts for a 16-bit field changing from `old` to `new`.
    #[inline(always)]
    pub fn u16(self, old: u16, new: u16) -> Self {
        Self(self.0 + u32::from(!old) + u32::from(new))
    }

    /// Accounts for a 32-bit field (an IPv4 address) changing.
    #[inline(always)]
    pub fn u32(self, old: u32, new: u32) -> Self {
        self.u16(old as u16, new as u16)
            .u16((old >> 16) as u16, (new >> 16) as u16)
    }

    /// Accounts for a 128-bit field (an IPv6 address) changing.
    #[inline(always)]
    pub fn addr6(self, old: &[u32; 4], new: &[u32; 4]) -> Self {
        self.u32(old[0], new[0])
            .u32(old[1], new[1])
            .u32(old[2], new[2])
            .u32(old[3], new[3])
    }

    /// The delta folded to 16 bits, as a flow entry keeps it
    /// (`FlowEntry::csum_ip`/`csum_l4`). Applying the folded delta gives
    /// the same checksum as applying the sum: folding keeps the value
    /// modulo 0xffff, and is 0 only for a sum of 0.
    #[inline(always)]
    pub fn folded(self) -> u16 {
        let mut sum = self.0;
        sum = (sum & 0xffff) + (sum >> 16);
        sum = (sum & 0xffff) + (sum >> 16);
        sum as u16
    }

    /// A delta kept folded ([`CsumDelta::folded`]).
    #[inline(always)]
    pub fn from_folded(folded: u16) -> Self {
        Self(u32::from(folded))
    }

    /// Applies the delta to checksum field `check`.
    #[inline(always)]
    pub fn apply(self, check: u16) -> u16 {
        // At most 36 terms below 2^17 were added (two IPv6 addresses, two
        // ports and a few more words): the sum stays below 2^32, and two
        // folds bring it to 16 bits.
        let mut sum = u32::from(!check) + self.0;
        sum = (sum & 0xffff) + (sum >> 16);
        sum = (sum & 0xffff) + (sum >> 16);
        !(sum as u16)
    }
}
