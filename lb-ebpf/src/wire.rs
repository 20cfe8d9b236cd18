//! The wire format: header lengths, field offsets, type codes and flags of
//! Ethernet, 802.1Q, IPv4, IPv6, TCP, UDP and ICMP, each defined once. Offsets
//! are from the start of their own header. (`IPPROTO_TCP` and `IPPROTO_UDP`
//! are in lb-common: flow and VIP keys carry them.)

/// Ethernet header length (no FCS in XDP), and offsets of its fields.
pub const ETH_LEN: usize = 14;
pub const ETH_DST_OFF: usize = 0;
pub const ETH_SRC_OFF: usize = 6;
pub const ETH_TYPE_OFF: usize = 12;

/// One 802.1Q / 802.1ad tag: TCI (2) + inner EtherType (2).
pub const VLAN_LEN: usize = 4;
/// Offset of the inner EtherType in a tag.
pub const VLAN_TYPE_OFF: usize = 2;

pub const ETH_P_IPV4: u16 = 0x0800;
pub const ETH_P_IPV6: u16 = 0x86dd;
pub const ETH_P_8021Q: u16 = 0x8100;
pub const ETH_P_8021AD: u16 = 0x88a8;

pub const IPPROTO_ICMP: u8 = 1;
pub const IPPROTO_ICMPV6: u8 = 58;

/// IPv4: header length bounds in bytes and in 32-bit words (IHL: 5 is the
/// bare header, 15 the maximum with options), and field offsets.
pub const IPV4_MIN_LEN: usize = 20;
pub const IHL_MIN: u8 = 5;
pub const IHL_MAX: u8 = 15;
pub const IPV4_TOT_LEN_OFF: usize = 2;
pub const IPV4_ID_OFF: usize = 4;
/// Flags and fragment offset.
pub const IPV4_FRAG_OFF: usize = 6;
pub const IPV4_PROTO_OFF: usize = 9;
pub const IPV4_CHECK_OFF: usize = 10;
pub const IPV4_SADDR_OFF: usize = 12;
pub const IPV4_DADDR_OFF: usize = 16;
/// More-fragments flag and fragment offset mask of the (host order) `frags` field.
pub const IP_MF: u16 = 0x2000;
pub const IP_OFFSET_MASK: u16 = 0x1fff;

/// IPv6 fixed header length, and offsets of its fields.
pub const IPV6_LEN: usize = 40;
pub const IPV6_PLEN_OFF: usize = 4;
pub const IPV6_NEXT_OFF: usize = 6;
pub const IPV6_SADDR_OFF: usize = 8;
pub const IPV6_DADDR_OFF: usize = 24;
/// IPv6 extension headers.
pub const IPV6_HOP_BY_HOP: u8 = 0;
pub const IPV6_ROUTING: u8 = 43;
pub const IPV6_FRAGMENT: u8 = 44;
pub const IPV6_DEST_OPTS: u8 = 60;
/// Generic extension headers are `8 * (1 + len)` bytes; the fragment header is 8.
pub const IPV6_EXT_UNIT: usize = 8;
/// Fragment header: offset (13 bits) and M flag in the 16-bit word at byte 2.
pub const IPV6_FRAG_OFFSET_MASK: u16 = 0xfff8;
pub const IPV6_FRAG_MORE: u16 = 0x0001;

/// TCP and UDP: ports at 0 and 2 for both.
pub const L4_SPORT_OFF: usize = 0;
pub const L4_DPORT_OFF: usize = 2;
/// TCP header without options, and the offsets of its data-offset, flags
/// and checksum fields.
pub const TCP_MIN_LEN: usize = 20;
pub const TCP_DOFF_OFF: usize = 12;
pub const TCP_FLAGS_OFF: usize = 13;
pub const TCP_CHECK_OFF: usize = 16;
/// Minimum TCP data offset in 32-bit words.
pub const DOFF_MIN: u8 = 5;
/// TCP flag bits, as in [`TCP_FLAGS_OFF`].
pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;

/// UDP checksum offset (the header is `network_types::udp::UdpHdr`). A
/// checksum of 0 means "none" (IPv4 only), so a computed 0 is sent as 0xffff.
pub const UDP_CHECK_OFF: usize = 6;
pub const UDP_NO_CHECKSUM: u16 = 0;
pub const UDP_CHECKSUM_ZERO: u16 = 0xffff;

/// ICMP: the header (type, code, checksum, 4 more bytes) before the quoted
/// packet, and the checksum's offset.
pub const ICMP_HDR_LEN: usize = 8;
pub const ICMP_CHECK_OFF: usize = 2;
/// ICMPv4 error types: destination unreachable (incl. fragmentation
/// needed) and time exceeded.
pub const ICMP_DEST_UNREACH: u8 = 3;
pub const ICMP_TIME_EXCEEDED: u8 = 11;
/// ICMPv6 error types: destination unreachable, packet too big, time exceeded.
pub const ICMPV6_DEST_UNREACH: u8 = 1;
pub const ICMPV6_PACKET_TOO_BIG: u8 = 2;
pub const ICMPV6_TIME_EXCEEDED: u8 = 3;
