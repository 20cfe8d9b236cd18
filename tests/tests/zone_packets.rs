//! Packet-level tests of zone-aware routing (issue 12), run with
//! `BPF_PROG_TEST_RUN` on the verified object: the zone descriptor and the
//! zone tables come from the control plane's own builder and writer
//! (`lb_lab::production::write_zone_tables`), the SYNs from the shared frame
//! builder, and each test checks which backend the program wrote into the
//! new flow's entry.
//!
//! Backend ids are given out zone by zone in block order, so the VIP's slot
//! block holds each zone's backends contiguously (as the control plane
//! orders it) and a backend's zone follows from its id.
//!
//! Tolerances, over `FLOWS` new flows: a zone's share of the flows within 3
//! points of its share (σ ≤ 0.8 points at this sample size); inside a zone,
//! the weight shares within 1 point for least-conn (deterministic up to
//! ties) and within 4 points (6 in the smaller zone) for the algorithms
//! that draw at random or whose cursor the zone draw subsamples at random.
//! Root only; each case runs pinned to one CPU in a fresh network namespace.
use std::net::Ipv4Addr;

use lb_common::{
    Algorithm, BACKEND_ACTIVE, BACKEND_EJECTED, Backend, BackendScore, IPPROTO_TCP, MAGLEV_MAP,
    MAX_ZONES, VIP_SCHEDULE_MAP, VIP_TABLES_MAP, VIP_WEIGHT_PREFIX_MAP, VIP_ZONES_MAP, VipZones,
    ZONE_SHARE_SCALE, ZoneBlock,
};
use lb_lab::{
    production::{self, ALGORITHMS, EBPF_OBJECT, SlotBackend, ZoneInput},
    trials::{self, packet_case, slug},
    xdp::{
        harness::*,
        isolate::private_bpffs,
        packet::{Pkt, TCP_SYN},
    },
};

/// New flows per distribution run.
const FLOWS: u32 = 4000;
/// Flow table: both directions of every flow of a run fit.
const TABLE_SIZE: u32 = 1 << 15;
const ALL: u32 = ZONE_SHARE_SCALE;
/// 70 % and 30 % of the new connections.
const SEVENTY: u32 = ZONE_SHARE_SCALE * 7 / 10;
const THIRTY: u32 = ZONE_SHARE_SCALE - SEVENTY;
const HALF: u32 = ZONE_SHARE_SCALE / 2;

/// One zone as a test declares it: its backends' weights and its share.
#[derive(Clone, Copy)]
struct Zone<'a> {
    weights: &'a [u32],
    share: u32,
}

const fn zone(weights: &[u32], share: u32) -> Zone<'_> {
    Zone { weights, share }
}

/// A loaded program with one zone-aware TCP VIP (id 0) running `algorithm`.
struct ZonedLb {
    lb: Lb,
    algorithm: Algorithm,
    /// Each backend id's zone (block index).
    zone_of: Vec<usize>,
    /// The blocks as written, for rewrites.
    blocks: Vec<ZoneInput>,
}

/// Backends of each zone in turn (ids `0..`), of the zone's weights (in
/// `Backend::weight` and as the effective weight in `BackendScore`), one
/// TCP VIP over all of them in that order, and its zone tables and
/// descriptor written by the control plane's writer.
fn setup(algorithm: Algorithm, zones: &[Zone], bias: u8) -> ZonedLb {
    let mut lb = Lb::load(EBPF_OBJECT, TABLE_SIZE);
    lb.config(true, SNAT_PORT_MIN, SNAT_PORT_MAX);
    let mut ids = Vec::new();
    let mut zone_of = Vec::new();
    let mut blocks = Vec::new();
    for (z, zone) in zones.iter().enumerate() {
        let mut slots = Vec::new();
        for &weight in zone.weights {
            let id = ids.len() as u32;
            slots.push(add_backend(&mut lb, id, weight));
            ids.push(id);
            zone_of.push(z);
        }
        blocks.push(ZoneInput {
            slots,
            share: zone.share,
            reference_cost: 0,
        });
    }
    lb.vip(0, HTTP, IPPROTO_TCP, algorithm, bias, &ids);
    with_pins(&mut lb, |dir| {
        production::write_zone_tables(dir, 0, algorithm as u8, Some(0), &blocks)
    })
    .expect("writing VIP 0's zone tables");
    ZonedLb {
        lb,
        algorithm,
        zone_of,
        blocks,
    }
}

/// Backend `id` of `weight`, active, with its score; its slot as the table
/// builders see it.
fn add_backend(lb: &mut Lb, id: u32, weight: u32) -> SlotBackend {
    lb.backend(id, BACKEND_ACTIVE);
    let mut backends = lb.array::<Backend>(lb_common::BACKENDS_MAP);
    let mut backend = backends.get(&id, 0).expect("backend");
    backend.weight = weight;
    backends.set(id, backend, 0).expect("set backend");
    lb.set_score(
        id,
        BackendScore {
            ewma_ns: 1_000_000,
            cost: 100_000_000 / u64::from(weight),
            weight,
            ..BackendScore::default()
        },
    );
    SlotBackend::new(id, &backend, weight)
}

/// The maps the control plane's table writer fills.
const WRITER_MAPS: [&str; 5] = [
    VIP_SCHEDULE_MAP,
    VIP_WEIGHT_PREFIX_MAP,
    MAGLEV_MAP,
    VIP_TABLES_MAP,
    VIP_ZONES_MAP,
];

/// Runs `write` with this program's writer maps pinned in the thread's
/// private BPF filesystem, and unpins them after.
fn with_pins<T>(
    lb: &mut Lb,
    write: impl FnOnce(&std::path::Path) -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    let dir = private_bpffs();
    for name in WRITER_MAPS {
        lb.map_mut(name)
            .pin(dir.join(name))
            .unwrap_or_else(|e| panic!("pinning {name}: {e}"));
    }
    let written = write(&dir);
    for name in WRITER_MAPS {
        std::fs::remove_file(dir.join(name)).unwrap_or_else(|e| panic!("unpinning {name}: {e}"));
    }
    written
}

/// A SYN from `client:port` to the VIP; returns the backend it went to.
fn syn_from(lb: &Lb, client: Ipv4Addr, port: u16) -> u32 {
    let (action, _) = lb.run(&Pkt::tcp((client, port), (VIP, HTTP), TCP_SYN).build());
    assert_eq!(action, XDP_TX, "SYN {client}:{port}: {:?}", lb.reasons());
    lb.flow(&key(IPPROTO_TCP, (client, port), (VIP, HTTP)))
        .expect("forward entry")
        .backend_id
}

/// The client of flow `i`: distinct 5-tuples over several addresses.
/// `round` shifts the addresses, so later runs on one program open new flows.
fn client(round: u32, i: u32) -> (Ipv4Addr, u16) {
    (
        Ipv4Addr::new(10, 9 + round as u8, (i / 1000) as u8, 1 + (i % 200) as u8),
        1024 + (i % 1000) as u16 * 7 + (i / 200 % 5) as u16,
    )
}

/// Backend ids of `n` new flows from distinct clients.
fn choices(lb: &Lb, round: u32, n: u32) -> Vec<u32> {
    (0..n)
        .map(|i| {
            let (addr, port) = client(round, i);
            syn_from(lb, addr, port)
        })
        .collect()
}

impl ZonedLb {
    fn name(&self) -> &'static str {
        self.algorithm.name()
    }

    /// The share of `chosen` that went to each zone.
    fn zone_shares(&self, chosen: &[u32]) -> Vec<f64> {
        let zones = self.blocks.len();
        let mut counts = vec![0usize; zones];
        for &id in chosen {
            counts[self.zone_of[id as usize]] += 1;
        }
        counts
            .iter()
            .map(|&c| c as f64 / chosen.len() as f64)
            .collect()
    }

    /// Each backend's share of the flows of `chosen` that went to zone `z`.
    fn shares_within(&self, chosen: &[u32], z: usize) -> Vec<f64> {
        let ids: Vec<u32> = self.blocks[z].slots.iter().map(|s| s.id).collect();
        let inside: Vec<u32> = chosen
            .iter()
            .copied()
            .filter(|&id| self.zone_of[id as usize] == z)
            .collect();
        ids.iter()
            .map(|id| inside.iter().filter(|&c| c == id).count() as f64 / inside.len() as f64)
            .collect()
    }
}

fn assert_close(what: &str, got: &[f64], want: &[f64], tolerance: f64) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tolerance,
            "{what}: entry {i} is {g:.3}, want {w:.3} ± {tolerance} (got {got:.3?})"
        );
    }
    println!("{what}: {got:.3?} (want {want:.3?})");
}

fn weight_shares(weights: &[u32]) -> Vec<f64> {
    let total: u32 = weights.iter().sum();
    weights
        .iter()
        .map(|&w| f64::from(w) / f64::from(total))
        .collect()
}

/// In-flight bias per algorithm: with bias 1 P2C spreads long-lived flows
/// by weight (as in the algorithms suite).
fn bias(algorithm: Algorithm) -> u8 {
    if algorithm == Algorithm::P2cEwma {
        1
    } else {
        0
    }
}

// ---------------------------------------------------------------------------
// Cases.

const ZONE_A: [u32; 4] = [1, 2, 3, 4];
const ZONE_B: [u32; 2] = [3, 1];

/// Zone a at 100 %: zone b's backends, in the same slot block, get nothing.
fn the_local_zone_takes_every_flow(algorithm: Algorithm) {
    let z = setup(
        algorithm,
        &[zone(&ZONE_A, ALL), zone(&[1, 1, 1, 1], 0)],
        bias(algorithm),
    );
    let chosen = choices(&z.lb, 0, 2000);
    let shares = z.zone_shares(&chosen);
    assert_eq!(shares, [1.0, 0.0], "{}: zone shares", z.name());
    // And the algorithm ran over the whole of zone a.
    for id in 0..4 {
        assert!(chosen.contains(&id), "{}: backend {id} unused", z.name());
    }
}

/// 70/30: the zones' shares follow, and inside each zone the algorithm's
/// weight distribution still holds.
fn spill_follows_the_shares(algorithm: Algorithm) {
    let z = setup(
        algorithm,
        &[zone(&ZONE_A, SEVENTY), zone(&ZONE_B, THIRTY)],
        bias(algorithm),
    );
    let chosen = choices(&z.lb, 0, FLOWS);
    let name = z.name();
    assert_close(
        &format!("{name}: zone shares"),
        &z.zone_shares(&chosen),
        &[0.7, 0.3],
        0.03,
    );
    let (want_a, want_b) = if algorithm == Algorithm::RoundRobin {
        (vec![0.25; 4], vec![0.5; 2])
    } else {
        (weight_shares(&ZONE_A), weight_shares(&ZONE_B))
    };
    let (tol_a, tol_b) = if algorithm == Algorithm::LeastConn {
        (0.01, 0.01)
    } else {
        (0.04, 0.06)
    };
    assert_close(
        &format!("{name}: inside zone a"),
        &z.shares_within(&chosen, 0),
        &want_a,
        tol_a,
    );
    assert_close(
        &format!("{name}: inside zone b"),
        &z.shares_within(&chosen, 1),
        &want_b,
        tol_b,
    );
}

/// Block order is failover order: the draw takes the first block whose
/// cumulative share exceeds it, and the last block what is left.
fn failover_follows_the_block_order(algorithm: Algorithm) {
    let b = bias(algorithm);
    // 50/50/0: the third never.
    let z = setup(
        algorithm,
        &[zone(&[1, 1], HALF), zone(&[1, 1], HALF), zone(&[1, 1], 0)],
        b,
    );
    let got = z.zone_shares(&choices(&z.lb, 0, 2000));
    assert_eq!(got[2], 0.0, "{}: {got:?}", z.name());
    assert_close(
        &format!("{}: 50/50/0", z.name()),
        &got,
        &[0.5, 0.5, 0.0],
        0.04,
    );
    // 0/100/0: only the second, though the third's cumulative share is
    // the same.
    let z = setup(
        algorithm,
        &[zone(&[1, 1], 0), zone(&[1, 1], ALL), zone(&[1, 1], 0)],
        b,
    );
    let got = z.zone_shares(&choices(&z.lb, 0, 1000));
    assert_eq!(got, [0.0, 1.0, 0.0], "{}: 0/100/0", z.name());
    // 30/0/0: the last block takes the 70 % the shares leave.
    let z = setup(
        algorithm,
        &[zone(&[1, 1], THIRTY), zone(&[1, 1], 0), zone(&[1, 1], 0)],
        b,
    );
    let got = z.zone_shares(&choices(&z.lb, 0, 2000));
    assert_eq!(got[1], 0.0, "{}: {got:?}", z.name());
    // 0.05 is about 5σ of 2,000 draws at 30 % (σ ≈ 0.0102): 0.04, about
    // 3.9σ, failed once in a clean clone's run (0.342).
    assert_close(
        &format!("{}: 30/0/rest", z.name()),
        &got,
        &[0.3, 0.0, 0.7],
        0.05,
    );
}

/// Zone a's backends are all ejected while it keeps half the share (the
/// window before the control plane moves the share): its flows go to the
/// rest of the VIP, none to an ejected backend, none refused.
fn an_out_of_service_zone_falls_back_to_the_whole_vip(algorithm: Algorithm) {
    let mut z = setup(
        algorithm,
        &[zone(&ZONE_A, HALF), zone(&ZONE_B, HALF)],
        bias(algorithm),
    );
    for id in 0..4 {
        z.lb.backend(id, BACKEND_EJECTED);
    }
    let chosen = choices(&z.lb, 0, 1000);
    assert!(
        chosen.iter().all(|&id| id >= 4),
        "{}: an ejected backend got a flow",
        z.name()
    );
    assert!(chosen.contains(&4) && chosen.contains(&5), "{}", z.name());
    // Every zone ejected but one backend of the last: still served.
    z.lb.backend(4, BACKEND_EJECTED);
    let chosen = choices(&z.lb, 1, 200);
    assert!(chosen.iter().all(|&id| id == 5), "{}: {chosen:?}", z.name());
}

/// The whole-VIP fallback looks past more slots than a block's scan does:
/// a zone of 40 ejected backends at 100 % still reaches the one behind it.
fn the_fallback_scans_every_slot_of_the_vip() {
    let weights = [1u32; 40];
    let mut z = setup(
        Algorithm::RoundRobin,
        &[zone(&weights, ALL), zone(&[1], 0)],
        0,
    );
    for id in 0..40 {
        z.lb.backend(id, BACKEND_EJECTED);
    }
    let chosen = choices(&z.lb, 0, 200);
    assert!(chosen.iter().all(|&id| id == 40), "{chosen:?}");
}

/// Clearing the zones (twice: a VIP without zones is no error) and writing
/// the whole-VIP tables: selection covers every backend again.
fn clearing_the_zones_restores_whole_vip_selection(algorithm: Algorithm) {
    let mut z = setup(
        algorithm,
        &[zone(&ZONE_A, ALL), zone(&ZONE_B, 0)],
        bias(algorithm),
    );
    assert_eq!(z.zone_shares(&choices(&z.lb, 0, 500)), [1.0, 0.0]);
    let slots: Vec<SlotBackend> = z.blocks.iter().flat_map(|b| b.slots.clone()).collect();
    with_pins(&mut z.lb, |dir| {
        production::clear_zones(dir, 0)?;
        production::clear_zones(dir, 0)?;
        production::write_tables(dir, 0, algorithm as u8, Some(0), &slots)
    })
    .expect("clearing the zones");
    let chosen = choices(&z.lb, 1, 2000);
    let shares = z.zone_shares(&chosen);
    assert!(
        shares[1] > 0.1,
        "{}: zone b's backends after the clear: {shares:?}",
        z.name()
    );
    for id in 0..6 {
        assert!(chosen.contains(&id), "{}: backend {id} unused", z.name());
    }
}

/// `update_zone_shares` moves the flows, and writes only what changed.
fn share_updates_move_the_flows() {
    let mut z = setup(
        Algorithm::RoundRobin,
        &[zone(&[1, 1], ALL), zone(&[1, 1], 0)],
        0,
    );
    assert_eq!(z.zone_shares(&choices(&z.lb, 0, 200)), [1.0, 0.0]);
    let blocks = z.blocks.clone();
    let wrote = with_pins(&mut z.lb, |dir| {
        production::write_zone_tables_then_shares(
            dir,
            0,
            Algorithm::RoundRobin as u8,
            &blocks,
            &[
                (vec![0, ALL], vec![0, 0]),
                (vec![0, ALL], vec![0, 0]),
                (vec![HALF, HALF], vec![0, 0]),
            ],
        )
    })
    .expect("updating the shares");
    assert_eq!(wrote, [true, false, true]);
    let got = z.zone_shares(&choices(&z.lb, 1, 2000));
    assert_close("after the updates", &got, &[0.5, 0.5], 0.04);
}

/// Descriptors the control plane never writes: the kernel still serves
/// every flow from the VIP's backends.
fn a_bad_zone_descriptor_never_refuses_a_flow() {
    // Round-robin reads no weight table, so the whole-VIP path's choices
    // do not depend on the zone layout of the tables.
    let mut z = setup(
        Algorithm::RoundRobin,
        &[zone(&[1, 1], ALL), zone(&[1, 1], 0)],
        0,
    );
    let write = |lb: &mut Lb, zones: VipZones| {
        let mut map: aya::maps::HashMap<_, u32, VipZones> =
            aya::maps::HashMap::try_from(lb.map_mut(VIP_ZONES_MAP)).expect("VIP_ZONES");
        map.insert(0, zones, 0).expect("VIP_ZONES");
    };
    let block = |first_slot, slot_count| ZoneBlock {
        first_slot,
        slot_count,
        cum_share: ALL,
        ..ZoneBlock::default()
    };
    let mut cases = Vec::new();
    // More blocks than there can be: the whole VIP.
    let mut too_many = VipZones {
        count: MAX_ZONES + 1,
        ..VipZones::default()
    };
    too_many.zones[0] = block(0, 2);
    cases.push(("count > MAX_ZONES", too_many));
    // Blocks past the VIP's slots, empty, or with a schedule run outside
    // the schedule block.
    let mut past = VipZones {
        count: 1,
        ..VipZones::default()
    };
    past.zones[0] = block(3, 4);
    cases.push(("block past the slots", past));
    let mut empty = past;
    empty.zones[0] = block(1, 0);
    cases.push(("empty block", empty));
    let mut huge = past;
    huge.zones[0] = block(u32::MAX, 2);
    cases.push(("first_slot overflows", huge));
    for (round, (what, zones)) in cases.into_iter().enumerate() {
        write(&mut z.lb, zones);
        let chosen = choices(&z.lb, round as u32 + 1, 200);
        assert!(chosen.iter().all(|&id| id < 4), "{what}: {chosen:?}");
    }
    // count == 0 (the zone panic): the whole VIP, every backend.
    write(&mut z.lb, VipZones::default());
    let chosen = choices(&z.lb, 9, 400);
    for id in 0..4 {
        assert!(chosen.contains(&id), "count 0: backend {id} unused");
    }
}

/// Weight dwarfing the others in a zone (their share: 1 in 10^9 each).
const HEAVY: u32 = 1_000_000_000;

/// The backends `n` new flows get, from the VIP's cursor `cursor` on, when
/// the zone `blocks` are in force and one block takes every flow (slot `i`
/// holds backend `i`): smooth WRR steps through that block's schedule run;
/// weighted random puts every flow on the block's heavy backend (a stray
/// flow has a chance of about 2 × 10^-9).
fn all_in_one_zone(algorithm: Algorithm, blocks: &[ZoneInput], cursor: u32, n: u32) -> Vec<u32> {
    let index = blocks
        .iter()
        .rposition(|b| b.share == ALL)
        .expect("a block with every flow");
    match algorithm {
        Algorithm::WeightedRoundRobin => {
            let set = production::build_zone_tables(algorithm, blocks).expect("zone tables");
            let z = set.zones.zones[index];
            let run = &set.schedule[z.schedule_first as usize..][..z.schedule_len as usize];
            (cursor..cursor + n)
                .map(|c| z.first_slot + run[c as usize % run.len()])
                .collect()
        }
        Algorithm::Random => {
            let heavy = blocks[index]
                .slots
                .iter()
                .max_by_key(|s| s.weight)
                .expect("a slot");
            vec![heavy.id; n as usize]
        }
        _ => unreachable!("only the table-driven algorithms"),
    }
}

/// `blocks` with zone `z`'s weights set to `weights` and the shares set
/// to `shares`.
fn reweighted(blocks: &[ZoneInput], z: usize, weights: &[u32], shares: &[u32]) -> Vec<ZoneInput> {
    let mut next = blocks.to_vec();
    for (slot, &w) in next[z].slots.iter_mut().zip(weights) {
        slot.weight = w;
    }
    for (block, &share) in next.iter_mut().zip(shares) {
        block.share = share;
    }
    next
}

/// A zone-aware VIP's tables built aside and swapped: the next zone tables
/// (new weights inside a zone, then the share moved to the other zone)
/// written aside leave every new flow where the old zone descriptor and
/// tables send it, step for step; the flip of the zone descriptor moves
/// them all. Two rounds, so both halves serve as the spare.
fn zone_tables_are_swapped_not_rewritten_in_place(algorithm: Algorithm) {
    const RUN: u32 = 14;
    let (a, b, a_next, b_next) = if algorithm == Algorithm::Random {
        ([HEAVY, 1, 1], [1, HEAVY], [1, 1, HEAVY], [HEAVY, 1])
    } else {
        ([5, 1, 1], [2, 1], [1, 1, 5], [1, 2])
    };
    let mut z = setup(algorithm, &[zone(&a, ALL), zone(&b, 0)], 0);
    let first = z.blocks.clone();
    let second = reweighted(&first, 0, &a_next, &[ALL, 0]);
    let third = reweighted(&second, 1, &b_next, &[0, ALL]);
    let mut cursor = 0;
    let mut run = |lb: &Lb, blocks: &[ZoneInput], what: &str| {
        let got = choices(lb, cursor / RUN, RUN);
        let want = all_in_one_zone(algorithm, blocks, cursor, RUN);
        assert_eq!(got, want, "{}: {what}", algorithm.name());
        cursor += RUN;
    };
    run(&z.lb, &first, "as first written");
    for (now, next, what) in [
        (&first, &second, "new weights"),
        (&second, &third, "new shares"),
    ] {
        let pending = with_pins(&mut z.lb, |dir| {
            production::write_zone_tables_aside(dir, 0, algorithm as u8, Some(0), next)
        })
        .expect("writing the zone tables aside");
        run(&z.lb, now, &format!("{what} aside, not flipped"));
        with_pins(&mut z.lb, |dir| production::flip_tables(dir, pending)).expect("flipping");
        run(&z.lb, next, &format!("{what} flipped in"));
    }
}

/// Kernel time per new flow in zone mode, against the whole-VIP path of
/// the same program (the zone path adds one hash lookup and the draw).
fn time_per_new_flow() {
    const RUNS: u32 = 2000;
    let mean_ns = |lb: &Lb, round: u32| {
        let total: u64 = (0..RUNS)
            .map(|i| {
                let (addr, port) = client(round, i);
                let frame = Pkt::tcp((addr, port), (VIP, HTTP), TCP_SYN).build();
                let (action, _, ns) = lb.run_repeat(&frame, 1);
                assert_eq!(action, XDP_TX);
                u64::from(ns)
            })
            .sum();
        total / u64::from(RUNS)
    };
    for algorithm in ALGORITHMS {
        let mut z = setup(algorithm, &[zone(&[1; 5], HALF), zone(&[1; 5], HALF)], 0);
        let zoned = mean_ns(&z.lb, 0);
        let slots: Vec<SlotBackend> = z.blocks.iter().flat_map(|b| b.slots.clone()).collect();
        with_pins(&mut z.lb, |dir| {
            production::clear_zones(dir, 0)?;
            production::write_tables(dir, 0, algorithm as u8, Some(0), &slots)
        })
        .expect("clearing the zones");
        let whole = mean_ns(&z.lb, 1);
        println!(
            "new flow, {}: {zoned} ns with zones, {whole} ns without",
            algorithm.name()
        );
        assert!(zoned < 100_000 && whole < 100_000);
    }
}

/// The cases that need nothing but one program, by name.
const CASES: &[(&str, fn())] = &[
    (
        "the_fallback_scans_every_slot_of_the_vip",
        the_fallback_scans_every_slot_of_the_vip,
    ),
    ("share_updates_move_the_flows", share_updates_move_the_flows),
    (
        "a_bad_zone_descriptor_never_refuses_a_flow",
        a_bad_zone_descriptor_never_refuses_a_flow,
    ),
    ("time_per_new_flow", time_per_new_flow),
];

/// A case run once per algorithm.
type PerAlgorithm = (&'static str, fn(Algorithm));

/// The cases run once per algorithm.
const PER_ALGORITHM: &[PerAlgorithm] = &[
    (
        "the_local_zone_takes_every_flow",
        the_local_zone_takes_every_flow,
    ),
    ("spill_follows_the_shares", spill_follows_the_shares),
    (
        "failover_follows_the_block_order",
        failover_follows_the_block_order,
    ),
    (
        "an_out_of_service_zone_falls_back_to_the_whole_vip",
        an_out_of_service_zone_falls_back_to_the_whole_vip,
    ),
    (
        "clearing_the_zones_restores_whole_vip_selection",
        clearing_the_zones_restores_whole_vip_selection,
    ),
];

/// The algorithms whose tables come in halves.
const HALVED: [Algorithm; 2] = [Algorithm::WeightedRoundRobin, Algorithm::Random];

fn main() {
    let mut trials: Vec<_> = CASES
        .iter()
        .map(|&(name, case)| packet_case(name, case))
        .collect();
    for &(name, case) in PER_ALGORITHM {
        for algorithm in ALGORITHMS {
            let name = format!("{name}::{}", slug(algorithm.name()));
            trials.push(packet_case(name, move || case(algorithm)));
        }
    }
    for algorithm in HALVED {
        let name = format!(
            "zone_tables_are_swapped_not_rewritten_in_place::{}",
            slug(algorithm.name())
        );
        trials.push(packet_case(name, move || {
            zone_tables_are_swapped_not_rewritten_in_place(algorithm);
        }));
    }
    trials::run("zone_packets", trials)
}
