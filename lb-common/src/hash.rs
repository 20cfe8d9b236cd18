//! The flow hash Maglev indexes its lookup table with. It lives here so the
//! XDP program and the tests that predict its choices compute the same value.

/// Mixes one 32-bit word into the running hash (multiply-rotate, as in
/// MurmurHash3's block step).
#[inline(always)]
const fn mix(h: u32, word: u32) -> u32 {
    let k = word
        .wrapping_mul(0xcc9e_2d51)
        .rotate_left(15)
        .wrapping_mul(0x1b87_3593);
    (h ^ k)
        .rotate_left(13)
        .wrapping_mul(5)
        .wrapping_add(0xe654_6b64)
}

/// MurmurHash3's finaliser: every input bit affects every output bit.
#[inline(always)]
const fn finish(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^ (h >> 16)
}

/// Hash of an IPv4 5-tuple as the packet carries it (addresses and ports in
/// wire order).
#[inline(always)]
pub const fn flow_hash_v4(saddr: u32, daddr: u32, sport: u16, dport: u16, proto: u8) -> u32 {
    let ports = ((sport as u32) << 16) | dport as u32;
    finish(mix(mix(mix(mix(0, saddr), daddr), ports), proto as u32))
}

/// Hash of the client address alone (source-IP affinity).
#[inline(always)]
pub const fn source_hash_v4(saddr: u32) -> u32 {
    finish(mix(0, saddr))
}

/// Folds an address (the `u32` words of `Packet::saddr`, IPv4 in word 0 and
/// the rest zero) into one word. An IPv4 address folds to itself, so IPv4
/// hashes equal the `_v4` functions'; the rotations keep IPv6 addresses
/// that differ in one word apart.
#[inline(always)]
pub const fn fold_addr(addr: [u32; 4]) -> u32 {
    addr[0] ^ addr[1].rotate_left(8) ^ addr[2].rotate_left(16) ^ addr[3].rotate_left(24)
}

/// [`flow_hash_v4`] for either family (addresses as four words).
#[inline(always)]
pub const fn flow_hash(saddr: [u32; 4], daddr: [u32; 4], sport: u16, dport: u16, proto: u8) -> u32 {
    flow_hash_v4(fold_addr(saddr), fold_addr(daddr), sport, dport, proto)
}

/// [`source_hash_v4`] for either family.
#[inline(always)]
pub const fn source_hash(saddr: [u32; 4]) -> u32 {
    source_hash_v4(fold_addr(saddr))
}
