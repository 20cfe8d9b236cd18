//! A frame builder for packet tests: Ethernet (with 802.1Q tags), IPv4 (with
//! options and fragment fields) or IPv6 (with extension headers), then TCP,
//! UDP or raw bytes. Every checksum is computed here from scratch (RFC 1071),
//! independently of the data path, so a test compares the program's output
//! against bytes it did not produce.
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use lb_common::{IPPROTO_TCP, IPPROTO_UDP};

/// Frames default to client → balancer MACs of the standard test topology.
pub const LB_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];
pub const CLIENT_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x02];

pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_PSH: u8 = 0x08;
pub const TCP_ACK: u8 = 0x10;
pub const TCP_URG: u8 = 0x20;

pub const ETH_P_IPV4: u16 = 0x0800;
pub const ETH_P_IPV6: u16 = 0x86dd;
pub const ETH_P_ARP: u16 = 0x0806;
pub const ETH_P_LLDP: u16 = 0x88cc;
pub const ETH_P_8021Q: u16 = 0x8100;
pub const ETH_P_8021AD: u16 = 0x88a8;

pub const IPPROTO_ICMP: u8 = 1;
pub const IPPROTO_ICMPV6: u8 = 58;
/// IPv6 extension header numbers.
pub const IPV6_HOP_BY_HOP: u8 = 0;
pub const IPV6_ROUTING: u8 = 43;
pub const IPV6_FRAGMENT: u8 = 44;
pub const IPV6_DEST_OPTS: u8 = 60;

/// The IPv4 flags/fragment-offset field of an unfragmented packet (DF set).
pub const IPV4_DF: u16 = 0x4000;
pub const IPV4_MF: u16 = 0x2000;

/// Ethernet header length without tags.
pub const ETH_LEN: usize = 14;
pub const IPV4_LEN: usize = 20;
pub const IPV6_LEN: usize = 40;
pub const TCP_LEN: usize = 20;
pub const UDP_LEN: usize = 8;

/// The transport part of a packet.
#[derive(Clone, Debug)]
pub enum L4 {
    Tcp {
        flags: u8,
        seq: u32,
        ack: u32,
        /// TCP options (a multiple of 4 bytes).
        options: Vec<u8>,
    },
    Udp {
        /// Send 0 ("no checksum", legal in IPv4 only).
        zero_checksum: bool,
    },
    /// Any other protocol: the bytes follow the IP headers verbatim.
    Raw { proto: u8 },
}

/// One IPv6 extension header.
#[derive(Clone, Debug)]
pub enum ExtHdr {
    /// Hop-by-hop, routing or destination options: `kind` and `len8` extra
    /// 8-byte units (the header is `8 * (len8 + 1)` bytes, padded with PadN).
    Options { kind: u8, len8: u8 },
    /// Fragment header.
    Fragment { offset: u16, more: bool, id: u32 },
    /// A segment routing header (type 4) with `segments_left` and one
    /// 16-byte segment.
    SourceRoute { segments_left: u8 },
}

impl ExtHdr {
    pub const fn kind(&self) -> u8 {
        match self {
            Self::Options { kind, .. } => *kind,
            Self::Fragment { .. } => IPV6_FRAGMENT,
            Self::SourceRoute { .. } => IPV6_ROUTING,
        }
    }

    fn encode(&self, next: u8) -> Vec<u8> {
        match *self {
            Self::Options { kind, len8 } => {
                let len = 8 * (usize::from(len8) + 1);
                let mut h = vec![next, len8];
                if kind == IPV6_ROUTING {
                    // Routing type 0 is deprecated; type 4 (SRH) with 0 segments left.
                    h.extend_from_slice(&[4, 0]);
                    h.resize(len, 0);
                } else {
                    // PadN options filling the rest (each at most 257 bytes).
                    let mut left = len - 2;
                    while left > 0 {
                        let n = left.min(257);
                        if n == 1 {
                            h.push(0); // Pad1
                        } else {
                            h.extend_from_slice(&[1, (n - 2) as u8]);
                            h.resize(h.len() + n - 2, 0);
                        }
                        left -= n;
                    }
                }
                h
            }
            Self::SourceRoute { segments_left } => {
                let mut h = vec![next, 2, 4, segments_left];
                h.resize(24, 0);
                h
            }
            Self::Fragment { offset, more, id } => {
                let mut h = vec![next, 0];
                h.extend_from_slice(&((offset << 3) | u16::from(more)).to_be_bytes());
                h.extend_from_slice(&id.to_be_bytes());
                h
            }
        }
    }
}

/// A packet description; [`Pkt::build`] turns it into frame bytes.
#[derive(Clone, Debug)]
pub struct Pkt {
    pub dst_mac: [u8; 6],
    pub src_mac: [u8; 6],
    /// 802.1Q TCIs, outermost first.
    pub vlans: Vec<u16>,
    pub src: IpAddr,
    pub dst: IpAddr,
    pub sport: u16,
    pub dport: u16,
    /// IPv4 TTL or IPv6 hop limit.
    pub ttl: u8,
    /// IPv4 options (a multiple of 4 bytes).
    pub ip_options: Vec<u8>,
    /// IPv4 flags and fragment offset field.
    pub ipv4_frag: u16,
    /// IPv6 extension headers, in order.
    pub ext: Vec<ExtHdr>,
    pub l4: L4,
    pub payload: Vec<u8>,
}

impl Pkt {
    pub fn tcp<A: Into<IpAddr>>(src: (A, u16), dst: (A, u16), flags: u8) -> Self {
        Self::new(
            src,
            dst,
            L4::Tcp {
                flags,
                seq: 1000,
                ack: if flags & TCP_ACK != 0 { 5000 } else { 0 },
                options: Vec::new(),
            },
        )
    }

    pub fn udp<A: Into<IpAddr>>(src: (A, u16), dst: (A, u16)) -> Self {
        Self::new(
            src,
            dst,
            L4::Udp {
                zero_checksum: false,
            },
        )
    }

    /// A packet of another protocol whose body is `body` (ports unused).
    pub fn raw<A: Into<IpAddr>>(src: A, dst: A, proto: u8, body: &[u8]) -> Self {
        Self::new((src, 0), (dst, 0), L4::Raw { proto }).payload(body)
    }

    pub fn new<A: Into<IpAddr>>(src: (A, u16), dst: (A, u16), l4: L4) -> Self {
        Self {
            dst_mac: LB_MAC,
            src_mac: CLIENT_MAC,
            vlans: Vec::new(),
            src: src.0.into(),
            dst: dst.0.into(),
            sport: src.1,
            dport: dst.1,
            ttl: 64,
            ip_options: Vec::new(),
            ipv4_frag: IPV4_DF,
            ext: Vec::new(),
            l4,
            payload: Vec::new(),
        }
    }

    pub fn macs(mut self, dst: [u8; 6], src: [u8; 6]) -> Self {
        self.dst_mac = dst;
        self.src_mac = src;
        self
    }

    pub fn payload(mut self, bytes: &[u8]) -> Self {
        self.payload = bytes.to_vec();
        self
    }

    pub fn vlans(mut self, tcis: &[u16]) -> Self {
        self.vlans = tcis.to_vec();
        self
    }

    pub fn ttl(mut self, ttl: u8) -> Self {
        self.ttl = ttl;
        self
    }

    pub fn ip_options(mut self, options: &[u8]) -> Self {
        self.ip_options = options.to_vec();
        self
    }

    pub fn ext(mut self, headers: &[ExtHdr]) -> Self {
        self.ext = headers.to_vec();
        self
    }

    /// The TCP sequence number (1000 by default).
    pub fn seq(mut self, value: u32) -> Self {
        if let L4::Tcp { seq, .. } = &mut self.l4 {
            *seq = value;
        }
        self
    }

    /// The TCP acknowledgment number (5000 by default with ACK, else 0).
    pub fn ack(mut self, value: u32) -> Self {
        if let L4::Tcp { ack, .. } = &mut self.l4 {
            *ack = value;
        }
        self
    }

    pub fn tcp_options(mut self, bytes: &[u8]) -> Self {
        if let L4::Tcp { options, .. } = &mut self.l4 {
            *options = bytes.to_vec();
        }
        self
    }

    pub fn udp_zero_checksum(mut self) -> Self {
        self.l4 = L4::Udp {
            zero_checksum: true,
        };
        self
    }

    /// The same segment with new addresses and MACs, as the balancer should
    /// emit it: the new source MAC is the old destination MAC.
    pub fn rewritten<A: Into<IpAddr>>(
        &self,
        src: (A, u16),
        dst: (A, u16),
        dst_mac: [u8; 6],
    ) -> Self {
        let mut p = self.clone();
        (p.src, p.sport, p.dst, p.dport) = (src.0.into(), src.1, dst.0.into(), dst.1);
        (p.dst_mac, p.src_mac) = (dst_mac, self.dst_mac);
        p
    }

    pub const fn is_v6(&self) -> bool {
        matches!(self.dst, IpAddr::V6(_))
    }

    pub fn proto(&self) -> u8 {
        match self.l4 {
            L4::Tcp { .. } => IPPROTO_TCP,
            L4::Udp { .. } => IPPROTO_UDP,
            L4::Raw { proto } => proto,
        }
    }

    /// Offset of the IP header in the built frame.
    pub fn l3_offset(&self) -> usize {
        ETH_LEN + 4 * self.vlans.len()
    }

    /// Offset of the transport header in the built frame.
    pub fn l4_offset(&self) -> usize {
        let ip = if self.is_v6() {
            IPV6_LEN + self.ext.iter().map(|e| e.encode(0).len()).sum::<usize>()
        } else {
            IPV4_LEN + self.ip_options.len()
        };
        self.l3_offset() + ip
    }

    /// The transport segment (header + payload) with its checksum.
    fn segment(&self) -> Vec<u8> {
        let mut l4 = Vec::new();
        let check_at = match &self.l4 {
            L4::Tcp {
                flags,
                seq,
                ack,
                options,
            } => {
                assert!(
                    options.len().is_multiple_of(4),
                    "TCP options are 32-bit words"
                );
                l4.extend_from_slice(&self.sport.to_be_bytes());
                l4.extend_from_slice(&self.dport.to_be_bytes());
                l4.extend_from_slice(&seq.to_be_bytes());
                l4.extend_from_slice(&ack.to_be_bytes());
                l4.extend_from_slice(&[((5 + options.len() / 4) as u8) << 4, *flags]);
                l4.extend_from_slice(&64_240u16.to_be_bytes());
                l4.extend_from_slice(&[0, 0, 0, 0]); // checksum, urgent pointer
                l4.extend_from_slice(options);
                Some(16)
            }
            L4::Udp { .. } => {
                l4.extend_from_slice(&self.sport.to_be_bytes());
                l4.extend_from_slice(&self.dport.to_be_bytes());
                l4.extend_from_slice(&((UDP_LEN + self.payload.len()) as u16).to_be_bytes());
                l4.extend_from_slice(&[0, 0]);
                Some(6)
            }
            L4::Raw { .. } => None,
        };
        l4.extend_from_slice(&self.payload);
        let Some(at) = check_at else {
            return l4;
        };
        let sum = match self.l4 {
            L4::Udp {
                zero_checksum: true,
            } => 0,
            _ => match l4_checksum(self.src, self.dst, self.proto(), &l4) {
                0 if self.proto() == IPPROTO_UDP => 0xffff,
                sum => sum,
            },
        };
        l4[at..at + 2].copy_from_slice(&sum.to_be_bytes());
        l4
    }

    pub fn build(&self) -> Vec<u8> {
        let mut f = Vec::new();
        f.extend_from_slice(&self.dst_mac);
        f.extend_from_slice(&self.src_mac);
        for tci in &self.vlans {
            f.extend_from_slice(&ETH_P_8021Q.to_be_bytes());
            f.extend_from_slice(&tci.to_be_bytes());
        }
        let l4 = self.segment();
        match (self.src, self.dst) {
            (IpAddr::V4(src), IpAddr::V4(dst)) => {
                f.extend_from_slice(&ETH_P_IPV4.to_be_bytes());
                f.extend_from_slice(&self.ipv4_header(src, dst, l4.len()));
            }
            (IpAddr::V6(src), IpAddr::V6(dst)) => {
                f.extend_from_slice(&ETH_P_IPV6.to_be_bytes());
                f.extend_from_slice(&self.ipv6_headers(src, dst, l4.len()));
            }
            _ => panic!("mixed address families in {self:?}"),
        }
        f.extend_from_slice(&l4);
        f
    }

    fn ipv4_header(&self, src: Ipv4Addr, dst: Ipv4Addr, l4_len: usize) -> Vec<u8> {
        assert!(
            self.ip_options.len().is_multiple_of(4),
            "IPv4 options are 32-bit words"
        );
        let ihl = 5 + self.ip_options.len() / 4;
        let mut ip = vec![0x40 | ihl as u8, 0];
        ip.extend_from_slice(&((ihl * 4 + l4_len) as u16).to_be_bytes());
        ip.extend_from_slice(&0x1234u16.to_be_bytes()); // id
        ip.extend_from_slice(&self.ipv4_frag.to_be_bytes());
        ip.extend_from_slice(&[self.ttl, self.proto(), 0, 0]);
        ip.extend_from_slice(&src.octets());
        ip.extend_from_slice(&dst.octets());
        ip.extend_from_slice(&self.ip_options);
        let sum = checksum(&[&ip]);
        ip[10..12].copy_from_slice(&sum.to_be_bytes());
        ip
    }

    fn ipv6_headers(&self, src: Ipv6Addr, dst: Ipv6Addr, l4_len: usize) -> Vec<u8> {
        let mut ext = Vec::new();
        for (i, h) in self.ext.iter().enumerate() {
            let next = self.ext.get(i + 1).map_or(self.proto(), ExtHdr::kind);
            ext.extend_from_slice(&h.encode(next));
        }
        let first = self.ext.first().map_or(self.proto(), ExtHdr::kind);
        let mut ip = vec![0x60, 0, 0, 0];
        ip.extend_from_slice(&((ext.len() + l4_len) as u16).to_be_bytes());
        ip.extend_from_slice(&[first, self.ttl]);
        ip.extend_from_slice(&src.octets());
        ip.extend_from_slice(&dst.octets());
        ip.extend_from_slice(&ext);
        ip
    }
}

/// TCP options of a Linux SYN: MSS, SACK_PERM, TS (`tsval`), NOP, WS.
pub fn linux_syn_options(tsval: u32) -> Vec<u8> {
    let mut o = vec![2, 4, 5, 180, 4, 2, 8, 10];
    o.extend_from_slice(&tsval.to_be_bytes());
    o.extend_from_slice(&[0, 0, 0, 0, 1, 3, 3, 7]);
    o
}

/// TCP options of a Linux segment after the handshake: NOP, NOP, TS
/// (`tsval`, echoing 9).
pub fn segment_options(tsval: u32) -> Vec<u8> {
    let mut o = vec![1, 1, 8, 10];
    o.extend_from_slice(&tsval.to_be_bytes());
    o.extend_from_slice(&[0, 0, 0, 9]);
    o
}

/// The Internet checksum (RFC 1071) over the concatenation of `parts`.
pub fn checksum(parts: &[&[u8]]) -> u16 {
    let bytes: Vec<u8> = parts.concat();
    let mut sum: u32 = bytes
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// The pseudo header of `src`, `dst`, `proto` and `len` for either family.
fn pseudo_header(src: IpAddr, dst: IpAddr, proto: u8, len: usize) -> Vec<u8> {
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => [
            &s.octets()[..],
            &d.octets(),
            &[0, proto],
            &(len as u16).to_be_bytes(),
        ]
        .concat(),
        (IpAddr::V6(s), IpAddr::V6(d)) => [
            &s.octets()[..],
            &d.octets(),
            &(len as u32).to_be_bytes(),
            &[0, 0, 0, proto],
        ]
        .concat(),
        _ => panic!("mixed address families"),
    }
}

/// The TCP/UDP (or ICMPv6) checksum of `segment` with its pseudo header.
pub fn l4_checksum(src: IpAddr, dst: IpAddr, proto: u8, segment: &[u8]) -> u16 {
    checksum(&[&pseudo_header(src, dst, proto, segment.len()), segment])
}

/// The parts of a frame a checker needs.
#[derive(Debug)]
pub struct Parsed {
    pub l3: usize,
    pub l4: usize,
    pub src: IpAddr,
    pub dst: IpAddr,
    pub proto: u8,
    /// End of the IP datagram in the frame.
    pub end: usize,
}

/// Parses a well-formed built frame: VLAN tags, IPv4 or IPv6 with any number
/// of extension headers. `None` for anything else.
pub fn parse(frame: &[u8]) -> Option<Parsed> {
    let mut at = 12;
    let mut ether_type = u16::from_be_bytes(frame.get(at..at + 2)?.try_into().ok()?);
    while ether_type == ETH_P_8021Q || ether_type == ETH_P_8021AD {
        at += 4;
        ether_type = u16::from_be_bytes(frame.get(at..at + 2)?.try_into().ok()?);
    }
    let l3 = at + 2;
    let ip = frame.get(l3..)?;
    match ether_type {
        ETH_P_IPV4 => {
            let ihl = usize::from(*ip.first()? & 0x0f) * 4;
            let tot = usize::from(u16::from_be_bytes(ip.get(2..4)?.try_into().ok()?));
            let src: [u8; 4] = ip.get(12..16)?.try_into().ok()?;
            let dst: [u8; 4] = ip.get(16..20)?.try_into().ok()?;
            Some(Parsed {
                l3,
                l4: l3 + ihl,
                src: IpAddr::from(src),
                dst: IpAddr::from(dst),
                proto: *ip.get(9)?,
                end: l3 + tot,
            })
        }
        ETH_P_IPV6 => {
            let plen = usize::from(u16::from_be_bytes(ip.get(4..6)?.try_into().ok()?));
            let src: [u8; 16] = ip.get(8..24)?.try_into().ok()?;
            let dst: [u8; 16] = ip.get(24..40)?.try_into().ok()?;
            let mut next = *ip.get(6)?;
            let mut off = IPV6_LEN;
            while matches!(
                next,
                IPV6_HOP_BY_HOP | IPV6_ROUTING | IPV6_DEST_OPTS | IPV6_FRAGMENT
            ) {
                let len = if next == IPV6_FRAGMENT {
                    8
                } else {
                    8 * (usize::from(*ip.get(off + 1)?) + 1)
                };
                next = *ip.get(off)?;
                off += len;
            }
            Some(Parsed {
                l3,
                l4: l3 + off,
                src: IpAddr::from(src),
                dst: IpAddr::from(dst),
                proto: next,
                end: l3 + IPV6_LEN + plen,
            })
        }
        _ => None,
    }
}

/// True when the frame parses and its checksums are valid (see [`verify_checksums`]).
pub fn checksums_valid(frame: &[u8]) -> bool {
    verify_checksums(frame).is_ok()
}

/// Checks, from scratch, the IPv4 header checksum and the TCP, UDP, ICMP or
/// ICMPv6 checksum of a frame. Panics with `what` on a mismatch.
pub fn assert_checksums_valid(frame: &[u8], what: &str) {
    if let Err(e) = verify_checksums(frame) {
        panic!("{what}: {e}");
    }
}

/// Verifies the IPv4 header checksum and the TCP, UDP (0 = none, IPv4
/// only), ICMP or ICMPv6 checksum of a frame, computed from scratch.
pub fn verify_checksums(frame: &[u8]) -> Result<(), String> {
    let p = parse(frame).ok_or("not an IP frame")?;
    if p.l3 > p.l4 || p.l4 > p.end || p.end > frame.len() {
        return Err(format!("headers or length out of the frame: {p:?}"));
    }
    if p.src.is_ipv4() && checksum(&[&frame[p.l3..p.l4]]) != 0 {
        return Err("IPv4 header checksum".into());
    }
    // A fragment holds part of a datagram: its TCP/UDP checksum covers the
    // whole one (see `reassemble`), so there is nothing to check here.
    if is_fragment(frame, &p) {
        return Ok(());
    }
    let segment = &frame[p.l4..p.end];
    let pseudo = |proto| l4_checksum(p.src, p.dst, proto, segment);
    let bad = match p.proto {
        IPPROTO_TCP => pseudo(IPPROTO_TCP) != 0,
        IPPROTO_UDP => {
            let sent = segment.get(6..8).ok_or("UDP header cut")?;
            let none = p.src.is_ipv4() && sent == [0, 0];
            !none && pseudo(IPPROTO_UDP) != 0
        }
        IPPROTO_ICMP => checksum(&[segment]) != 0,
        IPPROTO_ICMPV6 => pseudo(IPPROTO_ICMPV6) != 0,
        _ => false,
    };
    if bad {
        return Err(format!("protocol {} checksum", p.proto));
    }
    Ok(())
}

/// A frame of any EtherType with `body` after the Ethernet header.
pub fn ether_frame(dst: [u8; 6], src: [u8; 6], ether_type: u16, body: &[u8]) -> Vec<u8> {
    [&dst[..], &src, &ether_type.to_be_bytes(), body].concat()
}

/// Splits a built IPv4 or IPv6 frame (no IPv6 extension headers) into
/// fragments of at most `chunk` payload bytes (a multiple of 8), each with
/// the Ethernet and IP headers of `frame`, as a router would (RFC 791,
/// RFC 8200: IPv6 gets a fragment header). `id` is the identification
/// (16 bits used for IPv4).
pub fn fragment(frame: &[u8], chunk: usize, id: u32) -> Vec<Vec<u8>> {
    assert!(
        chunk > 0 && chunk.is_multiple_of(8),
        "fragment payload {chunk}"
    );
    let p = parse(frame).expect("an IP frame");
    let v4 = p.src.is_ipv4();
    let (header_end, next) = if v4 {
        (p.l4, p.proto)
    } else {
        assert_eq!(p.l4, p.l3 + IPV6_LEN, "no extension headers");
        (p.l3 + IPV6_LEN, p.proto)
    };
    let data = &frame[header_end..p.end];
    let pieces: Vec<&[u8]> = data.chunks(chunk).collect();
    pieces
        .iter()
        .enumerate()
        .map(|(i, piece)| {
            let offset = i * chunk;
            let more = i + 1 < pieces.len();
            let mut f = frame[..header_end].to_vec();
            if v4 {
                let ip = &mut f[p.l3..];
                let tot = (header_end - p.l3 + piece.len()) as u16;
                ip[2..4].copy_from_slice(&tot.to_be_bytes());
                ip[4..6].copy_from_slice(&(id as u16).to_be_bytes());
                let frag = (offset / 8) as u16 | if more { 0x2000 } else { 0 };
                ip[6..8].copy_from_slice(&frag.to_be_bytes());
                ip[10..12].copy_from_slice(&[0, 0]);
                let sum = checksum(&[&ip[..header_end - p.l3]]);
                ip[10..12].copy_from_slice(&sum.to_be_bytes());
            } else {
                let ip = &mut f[p.l3..];
                ip[4..6].copy_from_slice(&((8 + piece.len()) as u16).to_be_bytes());
                ip[6] = IPV6_FRAGMENT;
                let bits = ((offset / 8) as u16) << 3 | u16::from(more);
                f.extend_from_slice(&[next, 0]);
                f.extend_from_slice(&bits.to_be_bytes());
                f.extend_from_slice(&id.to_be_bytes());
            }
            f.extend_from_slice(piece);
            f
        })
        .collect()
}

/// The frame [`fragment`] split, put back together from `fragments` (in
/// any order): the first fragment's Ethernet and IP headers without the
/// fragmentation fields, and every payload at its offset. `None` if they
/// do not make one whole datagram.
pub fn reassemble(fragments: &[Vec<u8>]) -> Option<Vec<u8>> {
    let mut parts: Vec<(usize, bool, usize, &[u8])> = Vec::new();
    for f in fragments {
        let p = parse(f)?;
        if p.src.is_ipv4() {
            let bits = u16::from_be_bytes([f[p.l3 + 6], f[p.l3 + 7]]);
            let offset = usize::from(bits & 0x1fff) * 8;
            parts.push((offset, bits & 0x2000 != 0, p.l4, &f[p.l4..p.end]));
        } else {
            let frag = p.l3 + IPV6_LEN;
            if f[p.l3 + 6] != IPV6_FRAGMENT {
                return None;
            }
            let bits = u16::from_be_bytes([f[frag + 2], f[frag + 3]]);
            let offset = usize::from(bits >> 3) * 8;
            parts.push((offset, bits & 1 != 0, frag, &f[frag + 8..p.end]));
        }
    }
    parts.sort_by_key(|part| part.0);
    let (first_offset, _, header_end, _) = *parts.first()?;
    let last = parts.last()?;
    if first_offset != 0 || last.1 {
        return None;
    }
    let first = &fragments[fragments
        .iter()
        .position(|f| reassembly_offset(f) == Some(0))?];
    let p = parse(first)?;
    let mut whole = first[..header_end].to_vec();
    let mut expected = 0;
    for (offset, _, _, data) in &parts {
        if *offset != expected {
            return None;
        }
        whole.extend_from_slice(data);
        expected += data.len();
    }
    let ip = &mut whole[p.l3..];
    if p.src.is_ipv4() {
        let hdr = header_end - p.l3;
        ip[2..4].copy_from_slice(&((hdr + expected) as u16).to_be_bytes());
        ip[6..8].copy_from_slice(&[0, 0]);
        ip[10..12].copy_from_slice(&[0, 0]);
        let sum = checksum(&[&ip[..hdr]]);
        ip[10..12].copy_from_slice(&sum.to_be_bytes());
    } else {
        let next = first[header_end];
        ip[4..6].copy_from_slice(&(expected as u16).to_be_bytes());
        ip[6] = next;
    }
    Some(whole)
}

/// Whether the parsed frame is a fragment (IPv4 MF or offset, or an IPv6
/// fragment header that is not atomic).
fn is_fragment(frame: &[u8], p: &Parsed) -> bool {
    if p.src.is_ipv4() {
        let bits = u16::from_be_bytes([frame[p.l3 + 6], frame[p.l3 + 7]]);
        return bits & 0x3fff != 0;
    }
    // Walk the extension headers to a fragment header, as `parse` does.
    let mut next = frame[p.l3 + 6];
    let mut off = p.l3 + IPV6_LEN;
    while matches!(
        next,
        IPV6_HOP_BY_HOP | IPV6_ROUTING | IPV6_DEST_OPTS | IPV6_FRAGMENT
    ) && off + 8 <= frame.len()
    {
        if next == IPV6_FRAGMENT {
            let bits = u16::from_be_bytes([frame[off + 2], frame[off + 3]]);
            return bits & 0xfff9 != 0;
        }
        next = frame[off];
        off += 8 * (usize::from(frame[off + 1]) + 1);
    }
    false
}

/// The fragment offset of an IPv4 or IPv6 fragment frame.
fn reassembly_offset(frame: &[u8]) -> Option<usize> {
    let p = parse(frame)?;
    if p.src.is_ipv4() {
        let bits = u16::from_be_bytes([frame[p.l3 + 6], frame[p.l3 + 7]]);
        Some(usize::from(bits & 0x1fff) * 8)
    } else {
        let frag = p.l3 + IPV6_LEN;
        let bits = u16::from_be_bytes([*frame.get(frag + 2)?, *frame.get(frag + 3)?]);
        Some(usize::from(bits >> 3) * 8)
    }
}

#[cfg(test)]
mod fragment_tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use super::*;

    #[test]
    fn fragments_reassemble_to_the_original_in_any_order() {
        let mut v4 = Pkt::udp(
            (Ipv4Addr::new(10, 0, 2, 7), 40_000),
            (Ipv4Addr::new(10, 0, 0, 100), 53),
        )
        .payload(&[7u8; 4000]);
        // A datagram that may be fragmented: no DF.
        v4.ipv4_frag = 0;
        let v4 = v4.build();
        let v6 = Pkt::udp(
            (Ipv6Addr::new(0x2001, 0xdb8, 0, 2, 0, 0, 0, 7), 40_000),
            (Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x100), 53),
        )
        .payload(&[7u8; 4000])
        .build();
        for (frame, chunk) in [(&v4, 1480), (&v6, 1448)] {
            let mut pieces = fragment(frame, chunk, 0x1234);
            assert_eq!(pieces.len(), 3);
            for piece in &pieces {
                assert!(piece.len() <= 14 + 40 + 8 + 1480, "{}", piece.len());
            }
            // (Not assert_eq: a mismatch would print 4 KiB twice.)
            assert!(reassemble(&pieces).as_deref() == Some(frame.as_slice()));
            pieces.reverse();
            assert!(reassemble(&pieces).as_deref() == Some(frame.as_slice()));
            pieces.pop();
            assert!(
                reassemble(&pieces).is_none(),
                "the first fragment is missing"
            );
        }
    }
}
