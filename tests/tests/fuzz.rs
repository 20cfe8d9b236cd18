//! Fuzzing the XDP program through `BPF_PROG_TEST_RUN`: over a million
//! frames, mutated from a seed corpus of well-formed packets (every byte
//! position of every seed, then random havoc) and purely random ones, all
//! from fixed seeds so a failure reproduces. For every frame:
//! - the verdict is PASS, DROP, TX or REDIRECT (never ABORTED or garbage);
//! - a passed frame is byte-for-byte unchanged;
//! - a sent frame was addressed to a VIP or a SNAT address (only balanced
//!   traffic is ever modified), and if its checksums were valid, the
//!   rewritten frame's checksums are valid too.
//!
//! Afterwards the reason counters must add up to the number of frames.
//! Root only; pinned to one CPU in a fresh network namespace.
use std::{
    net::IpAddr,
    time::{Duration, Instant},
};

use lb_common::reason;
use lb_lab::xdp::{
    harness::*,
    isolate::run_isolated,
    packet::{
        ExtHdr, IPPROTO_ICMP, IPPROTO_ICMPV6, IPV4_MF, IPV6_HOP_BY_HOP, Pkt, TCP_ACK, TCP_FIN,
        TCP_PSH, TCP_SYN, checksums_valid, ether_frame, parse,
    },
    world::*,
};
use rand::{Rng, SeedableRng, rngs::StdRng};

/// The issue asks for at least this many frames.
const MIN_FRAMES: u64 = 1_000_000;
/// Values tried at every byte position of every seed.
const VALUES_PER_POSITION: usize = 24;
/// Havoc rounds: a seed with 1..=`MAX_HAVOC_EDITS` random edits.
const HAVOC_FRAMES: u64 = 700_000;
const MAX_HAVOC_EDITS: usize = 8;
/// Purely random frames (half of them with an IP EtherType).
const RANDOM_FRAMES: u64 = 120_000;
/// Frames are never shorter than an Ethernet header (the test-run minimum)
/// nor longer than a standard MTU frame.
const MIN_FRAME: usize = 14;
const MAX_FRAME: usize = 1514;
const SEED: u64 = 0x1b_f022_2026;

/// Well-formed frames: VIP traffic both ways, other traffic, odd shapes.
fn corpus() -> Vec<Vec<u8>> {
    let mut frames = Vec::new();
    for vip in [TCP80, P2C_MANY, RR_TCP, TCP80_6, P2C_MANY_6] {
        let client = (client_of(vip.addr), CLIENT_PORT);
        for flags in [TCP_SYN, TCP_ACK, TCP_ACK | TCP_PSH, TCP_FIN | TCP_ACK] {
            frames.push(
                Pkt::tcp(client, (vip.addr, vip.port), flags)
                    .payload(b"GET /")
                    .build(),
            );
        }
        let snat = (snat_of(vip.addr), SNAT_PORT_MIN);
        let backend = backend_ip(if vip.addr.is_ipv6() {
            FIRST_V6_BACKEND
        } else {
            0
        });
        frames.push(Pkt::tcp((backend, BACKEND_PORT), snat, TCP_SYN | TCP_ACK).build());
    }
    for vip in [UDP53, RR_UDP, UDP53_6] {
        let client = (client_of(vip.addr), CLIENT_PORT);
        frames.push(
            Pkt::udp(client, (vip.addr, vip.port))
                .payload(b"query")
                .build(),
        );
        frames.push(Pkt::udp(client, (vip.addr, vip.port)).vlans(&[7]).build());
    }
    let hbh = ExtHdr::Options {
        kind: IPV6_HOP_BY_HOP,
        len8: 0,
    };
    let frag = ExtHdr::Fragment {
        offset: 0,
        more: true,
        id: 1,
    };
    frames.push(
        Pkt::tcp((CLIENT6, 1), (VIP6, 80), TCP_SYN)
            .ext(std::slice::from_ref(&hbh))
            .build(),
    );
    frames.push(Pkt::udp((CLIENT6, 1), (VIP6, 53)).ext(&[hbh, frag]).build());
    frames.push(
        Pkt::tcp((CLIENT, 1), (VIP, 80), TCP_SYN)
            .ip_options(&[1; 12])
            .build(),
    );
    let mut fragment = Pkt::udp((CLIENT, 1), (VIP, 53));
    fragment.ipv4_frag = IPV4_MF;
    frames.push(fragment.build());
    frames.push(Pkt::raw(CLIENT, VIP, IPPROTO_ICMP, &[8, 0, 0, 0, 0, 1, 0, 1]).build());
    // ICMP errors quoting VIP traffic (a flow may exist for them).
    for vip in [TCP80, TCP80_6] {
        let sent = Pkt::tcp(
            (vip.addr, vip.port),
            (client_of(vip.addr), CLIENT_PORT),
            TCP_ACK,
        )
        .build();
        let l3 = 14;
        let quote_len = if vip.addr.is_ipv6() { 48 } else { 28 };
        let (proto, kind) = if vip.addr.is_ipv6() {
            (IPPROTO_ICMPV6, 2)
        } else {
            (IPPROTO_ICMP, 3)
        };
        let mut body = vec![kind, 4, 0, 0, 0, 0, 5, 0x78];
        body.extend_from_slice(&sent[l3..l3 + quote_len]);
        frames.push(Pkt::raw(stranger(vip.addr), vip.addr, proto, &body).build());
    }
    frames.push(Pkt::tcp((CLIENT, 1), (SNAT, 22), TCP_SYN).build());
    frames.push(ether_frame([0xff; 6], CLIENT_MAC, 0x0806, &[0; 28]));
    frames
}

/// Addresses whose traffic the balancer may rewrite.
fn balanced_destination(dst: IpAddr) -> bool {
    [IpAddr::from(VIP), VIP6.into(), SNAT.into(), SNAT6.into()].contains(&dst)
}

struct Fuzzer {
    lb: Lb,
    rng: StdRng,
    frames: u64,
}

impl Fuzzer {
    /// Runs one frame and checks the per-frame properties.
    fn check(&mut self, frame: &[u8]) {
        self.frames += 1;
        let (action, out) = self.lb.run(frame);
        let show = || format!("frame #{} {}", self.frames, hex(frame));
        match action {
            XDP_PASS => assert_eq!(out, frame, "passed frame modified: {}", show()),
            XDP_DROP => {}
            XDP_TX | XDP_REDIRECT => {
                let p = parse(frame).unwrap_or_else(|| panic!("sent a non-IP frame: {}", show()));
                assert!(
                    balanced_destination(p.dst),
                    "rewrote non-VIP traffic: {}",
                    show()
                );
                if checksums_valid(frame) {
                    assert!(checksums_valid(&out), "broke valid checksums: {}", show());
                }
            }
            other => panic!("invalid verdict {other}: {}", show()),
        }
    }

    /// Every byte position of `seed`, set to the boundary values and random ones.
    fn every_position(&mut self, seed: &[u8]) {
        for i in 0..seed.len() {
            for k in 0..VALUES_PER_POSITION {
                let mut f = seed.to_vec();
                f[i] = match k {
                    0 => 0,
                    1 => 0xff,
                    2 => seed[i] ^ 0x80,
                    3 => seed[i].wrapping_add(1),
                    4 => seed[i].wrapping_sub(1),
                    _ => self.rng.r#gen(),
                };
                self.check(&f);
            }
        }
    }

    /// A seed with a few random edits: byte sets, bit flips, cuts, growth,
    /// inserted tags and copied blocks.
    fn havoc(&mut self, seed: &[u8]) {
        let mut f = seed.to_vec();
        for _ in 0..self.rng.gen_range(1..=MAX_HAVOC_EDITS) {
            let at = self.rng.gen_range(0..f.len());
            match self.rng.gen_range(0..6) {
                0 => f[at] = self.rng.r#gen(),
                1 => f[at] ^= 1 << self.rng.gen_range(0..8),
                2 => f.truncate(at.max(MIN_FRAME)),
                3 => {
                    let n = self.rng.gen_range(1..64);
                    f.extend((0..n).map(|_| self.rng.r#gen::<u8>()));
                }
                4 => {
                    let at = at.max(12);
                    f.splice(at..at, [0x81, 0x00, 0x00, self.rng.r#gen()]);
                }
                _ => {
                    let from = self.rng.gen_range(0..f.len());
                    f[at] = f[from];
                }
            }
        }
        f.truncate(MAX_FRAME);
        self.check(&f);
    }

    fn random(&mut self) {
        let len = self.rng.gen_range(MIN_FRAME + 1..=256);
        let mut f: Vec<u8> = (0..len).map(|_| self.rng.r#gen()).collect();
        if self.rng.r#gen() {
            let ether_type: u16 = if self.rng.r#gen() { 0x0800 } else { 0x86dd };
            f[12..14].copy_from_slice(&ether_type.to_be_bytes());
            f[14] = if ether_type == 0x0800 { 0x45 } else { 0x60 };
        }
        self.check(&f);
    }
}

#[test]
fn fuzz() {
    lb_lab::require_root!();
    let (frames, counts, elapsed) = run_isolated(|| {
        let mut lb = Lb::new();
        world(&mut lb);
        let mut fz = Fuzzer {
            lb,
            rng: StdRng::seed_from_u64(SEED),
            frames: 0,
        };
        let started = Instant::now();
        let seeds = corpus();
        for seed in &seeds {
            fz.every_position(seed);
        }
        let positional = fz.frames;
        for _ in 0..HAVOC_FRAMES {
            let seed = &seeds[fz.rng.gen_range(0..seeds.len())];
            fz.havoc(seed);
        }
        for _ in 0..RANDOM_FRAMES {
            fz.random();
        }
        // Top up to the minimum with more havoc (the corpus size varies).
        while fz.frames < MIN_FRAMES {
            let seed = &seeds[fz.rng.gen_range(0..seeds.len())];
            fz.havoc(seed);
        }
        println!(
            "fuzz: {} seeds, {positional} positional mutations, {} frames in total",
            seeds.len(),
            fz.frames
        );
        (fz.frames, fz.lb.reason_counts(), started.elapsed())
    });
    println!("fuzz: {frames} frames in {:.1} s", elapsed.as_secs_f64());
    let mut verdicts = 0;
    for (r, n) in counts.iter().enumerate() {
        if *n > 0 {
            println!("  {:<22} {n}", reason::NAMES[r]);
        }
        if r != reason::EVENT_LOST as usize {
            verdicts += n;
        }
    }
    assert_eq!(
        verdicts, frames,
        "every frame counted under exactly one reason"
    );
    // The corpus reaches the main verdicts; a fuzz run that never balanced or
    // never dropped a truncated frame would have tested little.
    for r in [
        reason::TX_TO_BACKEND,
        reason::TX_TO_CLIENT,
        reason::PASS_NOT_IP,
        reason::PASS_NOT_VIP,
        reason::DROP_TRUNCATED,
        reason::DROP_BAD_HEADER,
    ] {
        assert!(
            counts[r as usize] > 0,
            "{} never fired",
            reason::NAMES[r as usize]
        );
    }
    assert!(
        elapsed < Duration::from_secs(600),
        "fuzzing took {elapsed:?}"
    );
}
