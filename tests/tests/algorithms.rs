//! Packet-level tests of every balancing algorithm in the XDP program, run
//! with `BPF_PROG_TEST_RUN` on the verified object: the tables come from the
//! control plane's own builders and writer (`lb_lab::production`), the SYNs
//! from the shared frame builder, and each test checks which backend the
//! program wrote into the new flow's entry, against expectations computed
//! here from the weights alone.
//!
//! Each case is its own test (`cargo test --test algorithms -- --list`);
//! the distribution and out-of-service cases are one test per algorithm.
//! Root only; each case runs pinned to one CPU in a fresh network namespace.
//!
//! Distribution tolerances (absolute share difference from the weight's
//! share, over `FLOWS` new flows to weights 1:2:3:4):
//! - weighted round-robin and least-conn are deterministic up to ties:
//!   within 1 percentage point;
//! - random, maglev and P2C draw at random: within 3 points, over 5
//!   standard deviations of a binomial share at this sample size (σ ≤ 0.8
//!   points for p = 0.4, n = 4000).
use std::net::Ipv4Addr;

use lb_common::{
    Algorithm, BACKEND_ACTIVE, BACKEND_EJECTED, Backend, BackendPending, BackendProgress,
    BackendScore, IPPROTO_TCP, MAGLEV_MAP, MAGLEV_TABLE_SIZE, MAX_BACKENDS_PER_VIP,
    SCORE_FAR_ABOVE, VIP_F_SOURCE_AFFINITY, VIP_SCHEDULE_MAP, VIP_TABLES_MAP,
    VIP_WEIGHT_PREFIX_MAP, VipMeta, VipTables, WRR_SCHEDULE_LEN, hash::flow_hash_v4,
    p2c::SATURATED_INFLIGHT,
};
use lb_lab::{
    production::{self, ALGORITHMS, EBPF_OBJECT, PendingFlip, SlotBackend, VipTableSet},
    trials::{self, packet_case, plain_case, slug},
    xdp::{
        harness::*,
        isolate::private_bpffs,
        packet::{Pkt, TCP_ACK, TCP_PSH, TCP_SYN},
    },
};

/// New flows per distribution run.
const FLOWS: u32 = 4000;
/// Flow table: both directions of every flow of a run fit.
const TABLE_SIZE: u32 = 1 << 15;
const WEIGHTS: [u32; 4] = [1, 2, 3, 4];

/// A program with backends `0..weights.len()` of those weights (in
/// `Backend::weight` and as the effective weight in `BackendScore`), one TCP
/// VIP over all of them running `algorithm`, and the VIP's tables as the
/// control plane would write them.
fn setup(algorithm: Algorithm, weights: &[u32], flags: u16, bias: u8) -> Lb {
    let mut lb = Lb::load(EBPF_OBJECT, TABLE_SIZE);
    lb.config(true, SNAT_PORT_MIN, SNAT_PORT_MAX);
    let ids: Vec<u32> = (0..weights.len() as u32).collect();
    let mut slots = Vec::new();
    for (&id, &weight) in ids.iter().zip(weights) {
        lb.backend(id, BACKEND_ACTIVE);
        let mut backends = lb.array::<Backend>(lb_common::BACKENDS_MAP);
        let mut backend = backends.get(&id, 0).expect("backend");
        backend.weight = weight;
        backends.set(id, backend, 0).expect("set backend");
        let score = BackendScore {
            ewma_ns: 1_000_000,
            cost: 100_000_000 / u64::from(weight),
            weight,
            ..BackendScore::default()
        };
        lb.set_score(id, score);
        slots.push(SlotBackend::new(id, &backend, weight));
    }
    lb.vip(0, HTTP, IPPROTO_TCP, algorithm, bias, &ids);
    write_tables(&mut lb, algorithm, &slots);
    if flags != 0 {
        edit_vip(&mut lb, |meta| meta.flags = flags);
    }
    lb
}

/// Changes VIP 0's `VipMeta` in place.
fn edit_vip(lb: &mut Lb, edit: impl FnOnce(&mut VipMeta)) {
    lb.edit_vip(HTTP, edit);
}

/// The maps the control plane's table writer fills.
const TABLE_MAPS: [&str; 4] = [
    VIP_SCHEDULE_MAP,
    VIP_WEIGHT_PREFIX_MAP,
    MAGLEV_MAP,
    VIP_TABLES_MAP,
];

/// VIP 0's tables for `slots`, built and written by the control plane's own
/// writer, through pins of this program's table maps in the thread's
/// private BPF filesystem.
fn write_tables(lb: &mut Lb, algorithm: Algorithm, slots: &[SlotBackend]) {
    with_table_pins(lb, |dir| {
        production::write_tables(dir, 0, algorithm as u8, Some(0), slots)
    })
    .expect("writing VIP 0's tables");
}

/// Runs `write` with this program's table maps pinned in the thread's
/// private BPF filesystem, and unpins them after.
fn with_table_pins<T>(
    lb: &mut Lb,
    write: impl FnOnce(&std::path::Path) -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    let dir = private_bpffs();
    for name in TABLE_MAPS {
        lb.map_mut(name)
            .pin(dir.join(name))
            .unwrap_or_else(|e| panic!("pinning {name}: {e}"));
    }
    let written = write(&dir);
    for name in TABLE_MAPS {
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
fn client(i: u32) -> (Ipv4Addr, u16) {
    (
        Ipv4Addr::new(10, 9, (i / 1000) as u8, 1 + (i % 200) as u8),
        1024 + (i % 1000) as u16 * 7 + (i / 200 % 5) as u16,
    )
}

/// Backend ids of `n` new flows from distinct clients.
fn choices(lb: &Lb, n: u32) -> Vec<u32> {
    choices_from(lb, 0, n)
}

/// Backend ids of `n` new flows from clients `first..first + n` (so later
/// runs on one program open new flows).
fn choices_from(lb: &Lb, first: u32, n: u32) -> Vec<u32> {
    (first..first + n)
        .map(|i| {
            let (addr, port) = client(i);
            syn_from(lb, addr, port)
        })
        .collect()
}

fn shares(chosen: &[u32], backends: usize) -> Vec<f64> {
    let mut counts = vec![0usize; backends];
    for &id in chosen {
        counts[id as usize] += 1;
    }
    counts
        .iter()
        .map(|&c| c as f64 / chosen.len() as f64)
        .collect()
}

fn assert_shares_follow(name: &str, got: &[f64], weights: &[u32], tolerance: f64) {
    let total: u32 = weights.iter().sum();
    for (i, (&share, &w)) in got.iter().zip(weights).enumerate() {
        let want = f64::from(w) / f64::from(total);
        assert!(
            (share - want).abs() <= tolerance,
            "{name}: backend {i} got {share:.3} of the flows, its weight's share is {want:.3} (shares {got:?})"
        );
    }
    println!("{name}: shares {got:.3?} for weights {weights:?}");
}

// ---------------------------------------------------------------------------
// Cases.

fn wrr_follows_the_smooth_schedule() {
    let lb = setup(Algorithm::WeightedRoundRobin, &[5, 1, 1], 0, 0);
    let got = choices(&lb, 14);
    assert_eq!(got, [0, 0, 1, 0, 2, 0, 0, 0, 0, 1, 0, 2, 0, 0]);
}

/// The weighted algorithms: their tolerance and in-flight bias.
const WEIGHTED: [(Algorithm, f64, u8); 5] = [
    (Algorithm::WeightedRoundRobin, 0.01, 0),
    (Algorithm::LeastConn, 0.01, 0),
    (Algorithm::Random, 0.03, 0),
    (Algorithm::Maglev, 0.03, 0),
    // With bias 1 P2C equalises cost × (inflight + 1) = inflight/weight
    // (up to the +1), so long-lived flows spread by weight. With the
    // default bias 2 they spread by √weight: the in-flight term is
    // deliberately stronger than the weight.
    (Algorithm::P2cEwma, 0.03, 1),
];

fn weighted_distribution(algorithm: Algorithm, tolerance: f64, bias: u8) {
    let lb = setup(algorithm, &WEIGHTS, 0, bias);
    let got = shares(&choices(&lb, FLOWS), WEIGHTS.len());
    assert_shares_follow(algorithm.name(), &got, &WEIGHTS, tolerance);
}

/// Weights far apart (a canary at weight 1 next to backends of weight 4),
/// every backend as fast, the re-draw bound the control plane's own
/// (`production::reference_cost` of the scores `setup` wrote) and the
/// saturation rule off, so the bound alone decides who is far above. The
/// bound is about speed: with it compared per weight, the weight-1
/// backend cost 4× the pool's median, lost every pair and took none of
/// the flows; it takes its weight's share (bias 1, as
/// `weighted_distribution`'s P2C case).
fn p2c_bound_does_not_hold_a_light_weight_out() {
    const SPREAD: [u32; 4] = [1, 4, 4, 4];
    let mut lb = setup(Algorithm::P2cEwma, &SPREAD, 0, 1);
    let scores: Vec<(u32, BackendScore)> = (0..SPREAD.len() as u32)
        .map(|id| (id, lb.score(id)))
        .collect();
    let reference = production::reference_cost(&scores);
    assert_eq!(
        reference, 100_000_000,
        "every backend is as fast: {scores:?}"
    );
    set_reference(&mut lb, reference);
    edit_vip(&mut lb, |meta| meta.p2c_saturation = 0);
    let got = shares(&choices(&lb, 1300), SPREAD.len());
    assert_shares_follow("p2c-ewma, the control plane's bound", &got, &SPREAD, 0.03);
    // A backend as heavy but 4x slower is still held out by that bound.
    let mut lb = setup(Algorithm::P2cEwma, &[4, 4, 4, 4], 0, 1);
    lb.set_score(
        0,
        BackendScore {
            ewma_ns: 4_000_000,
            cost: 100_000_000,
            weight: 4,
            ..BackendScore::default()
        },
    );
    let scores: Vec<(u32, BackendScore)> = (0..4).map(|id| (id, lb.score(id))).collect();
    set_reference(&mut lb, production::reference_cost(&scores));
    edit_vip(&mut lb, |meta| meta.p2c_saturation = 0);
    let slow = choices(&lb, 400).iter().filter(|&&id| id == 0).count();
    assert_eq!(slow, 0, "a 4x slower backend of the same weight");
}

fn round_robin_ignores_weights() {
    let lb = setup(Algorithm::RoundRobin, &WEIGHTS, 0, 0);
    let got = shares(&choices(&lb, FLOWS), WEIGHTS.len());
    assert_shares_follow("round-robin (ignores weights)", &got, &[1, 1, 1, 1], 0.001);
}

fn least_conn_picks_the_fewest_per_weight() {
    let mut lb = setup(Algorithm::LeastConn, &[1, 1, 2], 0, 0);
    lb.set_opened(0, 3);
    lb.set_opened(1, 1);
    lb.set_opened(2, 4);
    // Ratios 3/1, 1/1, 4/2: backend 1 is least loaded.
    assert_eq!(syn_from(&lb, CLIENT, 1000), 1);
    // Now 3/1, 2/1, 4/2: backends 1 and 2 tie; both must be drawn.
    let mut seen = [0u32; 3];
    for port in 0..64 {
        let mut lb = setup(Algorithm::LeastConn, &[1, 1, 2], 0, 0);
        lb.set_opened(0, 3);
        lb.set_opened(1, 2);
        lb.set_opened(2, 4);
        seen[syn_from(&lb, CLIENT, 2000 + port) as usize] += 1;
    }
    assert_eq!(seen[0], 0, "{seen:?}");
    assert!(
        seen[1] > 8 && seen[2] > 8,
        "ties must be broken at random: {seen:?}"
    );
}

/// Backend `id` has `requests` requests pending, started in total
/// `served_ns` before now (all at one start time: only the sum counts).
fn set_served(lb: &mut Lb, id: u32, requests: u64, served_ns: u64) {
    let now = monotonic_ns();
    let pending = BackendPending {
        requests,
        started_sum_ns: requests.wrapping_mul(now).wrapping_sub(served_ns),
    };
    lb.set_pending(id, pending);
}

fn least_conn_breaks_ties_by_the_work_already_done() {
    // Backends 1 and 2 tie at 2 connections per weight unit (backend 0 has
    // more); backend 2's two pending requests have been served 15 ms in
    // total, backend 1's 4 ms: backend 2 frees a worker first, every time.
    for port in 0..32 {
        let mut lb = setup(Algorithm::LeastConn, &[1, 1, 1], 0, 0);
        lb.set_opened(0, 3);
        lb.set_opened(1, 2);
        lb.set_opened(2, 2);
        set_served(&mut lb, 1, 2, 4_000_000);
        set_served(&mut lb, 2, 2, 15_000_000);
        assert_eq!(syn_from(&lb, CLIENT, 3000 + port), 2, "port {port}");
    }
    // The count still comes first: fewer connections beat more work done.
    let mut lb = setup(Algorithm::LeastConn, &[1, 1, 1], 0, 0);
    lb.set_opened(0, 3);
    lb.set_opened(1, 1);
    lb.set_opened(2, 2);
    set_served(&mut lb, 2, 2, 15_000_000);
    assert_eq!(syn_from(&lb, CLIENT, 4000), 1);
}

fn p2c_full_scan_breaks_ties_by_the_work_already_done() {
    // Four equal backends, each with a flow in flight (so no pair winner
    // is idle and the full scan decides), backend 3's pending request
    // served longest: the scan's tie among four equal ranks goes to it.
    for port in 0..32 {
        let mut lb = setup(Algorithm::P2cEwma, &[1; 4], 0, 0);
        edit_vip(&mut lb, |meta| meta.p2c_full_scan = 16);
        for id in 0..4 {
            let score = BackendScore {
                ewma_ns: 3_600_000_000_000,
                cost: 10_000_000,
                weight: 1,
                ..BackendScore::default()
            };
            lb.set_score(id, score);
            lb.set_opened(id, 1);
            set_served(&mut lb, id, 1, 1_000_000 * u64::from(id + 1));
        }
        assert_eq!(syn_from(&lb, CLIENT, 5000 + port), 3, "port {port}");
    }
}

fn maglev_uses_the_control_planes_table() {
    let weights = [1, 1, 1, 1, 1];
    let mut lb = setup(Algorithm::Maglev, &weights, 0, 0);
    let slots: Vec<_> = (0..5)
        .map(|id| {
            let backend = Backend {
                addr: words(backend_addr(id).into()).0,
                port: BACKEND_PORT.to_be(),
                ..Backend::default()
            };
            SlotBackend::new(id, &backend, 1)
        })
        .collect();
    let table = VipTableSet::build(Algorithm::Maglev, &slots).maglev;
    // The writer stores the table through its memory mapping of MAGLEV
    // (the map is BPF_F_MMAPABLE), so the SYNs below check that path.
    let mapped = with_table_pins(&mut lb, production::maglev_mapped).expect("opening the writer");
    assert!(mapped, "MAGLEV is not memory-mapped by the control plane");
    for i in 0..200 {
        let (addr, port) = client(i);
        let hash = flow_hash_v4(
            u32::from_ne_bytes(addr.octets()),
            u32::from_ne_bytes(VIP.octets()),
            port.to_be(),
            HTTP.to_be(),
            IPPROTO_TCP,
        );
        let want = table[(hash % MAGLEV_TABLE_SIZE) as usize];
        assert_eq!(syn_from(&lb, addr, port), want, "flow {addr}:{port}");
    }
}

/// A restart whose configuration dropped Maglev VIP 0 but kept VIP 1:
/// until VIP 0 leaves VIPS its SYNs still hash into the table its
/// descriptor names. (The restart takes it out of VIPS before writing any
/// table, `Publisher::move_table_readers`; this is the writer's own guard
/// for a VIP left there.) The restarted writer claims that table
/// (`TableWriter::claim_live`), so VIP 1's new table goes elsewhere;
/// without the claim it went into VIP 0's table, and VIP 0's new
/// connections to VIP 1's backends.
fn a_restart_keeps_a_dropped_maglev_vips_table_until_it_is_removed() {
    let mut lb = setup(Algorithm::Maglev, &[1, 1, 1, 1], 0, 0);
    let maglev = Algorithm::Maglev as u8;
    let (first, second) = {
        let backends = lb.array::<Backend>(lb_common::BACKENDS_MAP);
        let slot = |id: u32| SlotBackend::new(id, &backends.get(&id, 0).expect("backend"), 1);
        ([slot(2), slot(3)], [slot(1), slot(3)])
    };
    let table_of = |lb: &mut Lb, vip_id: u32| {
        lb.array::<VipTables>(VIP_TABLES_MAP)
            .get(&vip_id, 0)
            .expect("VIP_TABLES")
            .maglev_table
    };
    let read = |lb: &mut Lb, vip_id: u32| {
        with_table_pins(lb, |dir| production::read_vip_maglev_table(dir, vip_id))
            .expect("reading a VIP's table")
    };
    // The previous instance: VIP 0 (from `setup`) and VIP 1, each in a
    // table of its own.
    let dropped_table = table_of(&mut lb, 0);
    let write = |lb: &mut Lb, planned: &[(u32, u32)], live: Option<&[u32]>, slots| {
        with_table_pins(lb, |dir| {
            production::write_tables_after_restart(dir, planned, live, 1, maglev, slots)
        })
        .expect("VIP 1's tables")
    };
    write(
        &mut lb,
        &[(0, dropped_table), (1, dropped_table)],
        None,
        &first,
    );
    let kept_table = table_of(&mut lb, 1);
    assert_ne!(kept_table, dropped_table);
    let dropped = read(&mut lb, 0);
    // The restarted writer plans VIP 1 only, VIP 0 still in VIPS.
    write(&mut lb, &[(1, kept_table)], Some(&[0]), &second);
    assert_eq!(table_of(&mut lb, 0), dropped_table);
    assert_eq!(read(&mut lb, 0), dropped, "VIP 0's table written over");
    assert_ne!(table_of(&mut lb, 1), dropped_table);
    let kept: std::collections::BTreeSet<u32> = read(&mut lb, 1).into_iter().collect();
    assert_eq!(kept, [1, 3].into(), "VIP 1 on its new backends");
    // The hazard the claim prevents: a writer that claims the planned
    // tables only takes VIP 0's as its spare when it is the lowest free
    // (the tables below it are planned for other VIPs here).
    let kept_table = table_of(&mut lb, 1);
    let mut planned = vec![(1, kept_table)];
    planned.extend((0..dropped_table).map(|t| (100 + t, t)));
    write(&mut lb, &planned, None, &first);
    assert_eq!(table_of(&mut lb, 1), dropped_table, "without the claim");
    assert_ne!(read(&mut lb, 0), dropped, "without the claim");
}

fn maglev_source_affinity_keeps_a_client_on_one_backend() {
    let lb = setup(Algorithm::Maglev, &[1, 1, 1, 1], VIP_F_SOURCE_AFFINITY, 0);
    let mut backends_used = std::collections::BTreeSet::new();
    for c in 0..20u8 {
        let addr = Ipv4Addr::new(10, 8, 0, 1 + c);
        let first = syn_from(&lb, addr, 3000);
        for port in 3001..3020 {
            assert_eq!(syn_from(&lb, addr, port), first, "client {addr}");
        }
        backends_used.insert(first);
    }
    assert!(
        backends_used.len() >= 3,
        "clients spread: {backends_used:?}"
    );
}

fn out_of_service_backends_are_never_chosen(algorithm: Algorithm) {
    let mut lb = setup(algorithm, &WEIGHTS, 0, 0);
    // Ejected while still in the slots and tables (the window before the
    // control plane rewrites them).
    lb.backend(3, BACKEND_EJECTED);
    let got = choices(&lb, 400);
    assert!(
        !got.contains(&3),
        "{}: an ejected backend got a flow",
        algorithm.name()
    );
    assert!(got.contains(&0) && got.contains(&2), "{}", algorithm.name());
}

fn tables_cover_the_limits() {
    // The largest VIP fits the schedule; MAX_BACKENDS_PER_VIP sums fit u32.
    let weights: Vec<u32> = (0..MAX_BACKENDS_PER_VIP).map(|i| 1 + i % 7).collect();
    let slots: Vec<_> = weights
        .iter()
        .enumerate()
        .map(|(i, &w)| SlotBackend::new(i as u32, &Backend::default(), w))
        .collect();
    let set = VipTableSet::build(Algorithm::WeightedRoundRobin, &slots);
    assert!(set.schedule.len() <= WRR_SCHEDULE_LEN as usize);
}

// ---------------------------------------------------------------------------
// Tables built aside and swapped (`lb_user::publish::swap`): the next
// tables go into the half the kernel does not read, and only the flip of
// the descriptor makes new flows use them.

/// VIP 0's slots as `setup` configures them (backend `i` in slot `i`), at
/// effective weights `weights`.
fn slots_at(lb: &mut Lb, weights: &[u32]) -> Vec<SlotBackend> {
    let backends = lb.array::<Backend>(lb_common::BACKENDS_MAP);
    (0..weights.len() as u32)
        .zip(weights)
        .map(|(id, &w)| SlotBackend::new(id, &backends.get(&id, 0).expect("backend"), w))
        .collect()
}

/// Writes VIP 0's tables for `slots` aside, with the production writer.
fn write_aside(lb: &mut Lb, algorithm: Algorithm, slots: &[SlotBackend]) -> PendingFlip {
    with_table_pins(lb, |dir| {
        production::write_tables_aside(dir, 0, algorithm as u8, Some(0), slots)
    })
    .expect("writing VIP 0's tables aside")
}

fn flip(lb: &mut Lb, pending: PendingFlip) {
    with_table_pins(lb, |dir| production::flip_tables(dir, pending)).expect("flipping VIP 0");
}

/// VIP 0's descriptor as the kernel holds it.
fn descriptor(lb: &mut Lb) -> VipTables {
    lb.array::<VipTables>(VIP_TABLES_MAP)
        .get(&0, 0)
        .expect("VIP_TABLES")
}

/// What smooth WRR gives `n` new flows from cursor `cursor` on, over
/// `schedule` (slot `i` holds backend `i`).
fn wrr_run(schedule: &[u32], cursor: u32, n: u32) -> Vec<u32> {
    (cursor..cursor + n)
        .map(|c| schedule[c as usize % schedule.len()])
        .collect()
}

/// Smooth WRR: tables for new weights written aside leave every new flow
/// on the old schedule, step for step; the flip moves them all to the new
/// one. Twice, so both halves serve as the spare. The schedules differ in
/// length (7 and 4 entries), so the kernel must also keep the live half's
/// length while the spare half's changes.
fn wrr_tables_are_swapped_not_rewritten_in_place() {
    const RUN: u32 = 14;
    let (old_w, new_w) = ([5, 1, 1], [1, 2, 1]);
    let algorithm = Algorithm::WeightedRoundRobin;
    let mut lb = setup(algorithm, &old_w, 0, 0);
    let old = VipTableSet::build(algorithm, &slots_at(&mut lb, &old_w)).schedule;
    let new = VipTableSet::build(algorithm, &slots_at(&mut lb, &new_w)).schedule;
    assert_eq!((old.len(), new.len()), (7, 4));
    let mut cursor = 0;
    let mut run = |lb: &Lb, schedule: &[u32], what: &str| {
        let got = choices_from(lb, cursor, RUN);
        assert_eq!(got, wrr_run(schedule, cursor, RUN), "{what}");
        cursor += RUN;
    };
    run(&lb, &old, "as first written");
    let rounds = [(&new_w, &old, &new, "new"), (&old_w, &new, &old, "old")];
    for (next_w, now, next, name) in rounds {
        let before = descriptor(&mut lb);
        let spare = before.half ^ 1;
        let next_slots = slots_at(&mut lb, next_w);
        let pending = write_aside(&mut lb, algorithm, &next_slots);
        // Written: the spare half's length moved, the live half did not.
        let aside = descriptor(&mut lb);
        assert_eq!(aside.half, before.half, "{name}: flipped before the flip");
        assert_eq!(aside.live_schedule_len(), now.len() as u32);
        assert_eq!(aside.schedule_len[spare as usize], next.len() as u32);
        run(&lb, now, &format!("{name} tables aside, not flipped"));
        flip(&mut lb, pending);
        assert_eq!(descriptor(&mut lb).half, spare, "{name}: flip");
        run(&lb, next, &format!("{name} tables flipped in"));
    }
}

/// Weight dwarfing the others (their share: 1 in 10^9 each).
const HEAVY: u32 = 1_000_000_000;

/// Weighted random: the running sums of new weights written aside leave
/// new flows on the old distribution; the flip moves them. Each table puts
/// all but 10^-9 of the weight on one backend, so "the old distribution"
/// is one backend for every flow (a stray flow has a chance of about
/// 2 × 10^-9 each).
fn random_sums_are_swapped_not_rewritten_in_place() {
    const RUN: u32 = 300;
    let algorithm = Algorithm::Random;
    let tables = [[HEAVY, 1, 1], [1, HEAVY, 1], [1, 1, HEAVY]];
    let mut lb = setup(algorithm, &tables[0], 0, 0);
    let mut first = 0;
    let mut run = |lb: &Lb, heavy: u32, what: &str| {
        let got = choices_from(lb, first, RUN);
        assert!(
            got.iter().all(|&id| id == heavy),
            "{what}: want every flow on backend {heavy}, got {:?}",
            shares(&got, 3)
        );
        first += RUN;
    };
    run(&lb, 0, "as first written");
    for (step, next) in tables.iter().enumerate().skip(1) {
        let now = step as u32 - 1;
        let next_slots = slots_at(&mut lb, next);
        let pending = write_aside(&mut lb, algorithm, &next_slots);
        run(&lb, now, &format!("table {step} aside, not flipped"));
        flip(&mut lb, pending);
        run(&lb, step as u32, &format!("table {step} flipped in"));
    }
}

/// The kernel's clock (`bpf_ktime_get_ns` is CLOCK_MONOTONIC).
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Backend `id` last answered at `at_ns` and has a request outstanding
/// since.
fn set_progress(lb: &mut Lb, id: u32, at_ns: u64) {
    let progress = BackendProgress {
        answered_ns: at_ns,
        requested_ns: at_ns,
    };
    lb.set_progress(id, progress);
}

fn set_reference(lb: &mut Lb, cost: u64) {
    let mut tables = lb.array::<VipTables>(lb_common::VIP_TABLES_MAP);
    let mut t = tables.get(&0, 0).expect("tables");
    t.reference_cost = cost;
    tables.set(0, t, 0).expect("tables");
}

/// Ten backends, the last two with 10× the cost of the others. SYNs ask
/// nothing of a backend, so no stall age runs (an EWMA of an hour would
/// keep one below the threshold anyway), leaving the costs as written.
fn hetero_p2c() -> Lb {
    let mut lb = setup(Algorithm::P2cEwma, &[1; 10], 0, 0);
    for id in 0..10 {
        let cost = if id >= 8 { 1_000_000_000 } else { 100_000_000 };
        let score = BackendScore {
            ewma_ns: 3_600_000_000_000,
            cost,
            weight: 1,
            ..BackendScore::default()
        };
        lb.set_score(id, score);
    }
    lb
}

/// Backend ids of `n` new flows, each closed again in the counters before
/// the next (so every pick sees nothing in flight).
fn idle_choices(lb: &mut Lb, n: u32) -> Vec<u32> {
    (0..n)
        .map(|i| {
            let (addr, port) = client(i);
            let id = syn_from(lb, addr, port);
            lb.set_opened(id, 0);
            id
        })
        .collect()
}

fn p2c_redraws_when_both_draws_are_far_above_the_pool() {
    // With nothing in flight, every pick compares the costs alone: without
    // a reference (re-draws off) a pair of one fast and one slow goes to
    // the fast one and a pair of two slow to a slow one (2 % of pairs);
    // with re-draws, a slow pair is drawn again.
    let mut lb = hetero_p2c();
    let plain = shares(&idle_choices(&mut lb, 1000), 10);
    let plain_slow = plain[8] + plain[9];
    let mut lb = hetero_p2c();
    set_reference(&mut lb, 100_000_000);
    let redrawn = shares(&idle_choices(&mut lb, 1000), 10);
    let redrawn_slow = redrawn[8] + redrawn[9];
    println!("slow share: {plain_slow:.3} plain, {redrawn_slow:.3} with re-draws");
    assert!(plain_slow > 0.005, "{plain:?}");
    assert!(redrawn_slow < 0.002, "{redrawn:?}");
}

fn p2c_admits_far_above_backends_once_the_others_are_saturated() {
    // Long-lived flows, full scan: the slow pair (10× the cost, far above
    // the bound) gets nothing while any fast backend has fewer than
    // SATURATED_INFLIGHT flows, then competes on score.
    let mut lb = hetero_p2c();
    set_reference(&mut lb, 100_000_000);
    edit_vip(&mut lb, |meta| meta.p2c_full_scan = 16);
    let fill = 8 * SATURATED_INFLIGHT as u32;
    let first = choices(&lb, fill);
    assert!(first.iter().all(|&id| id < 8), "{first:?}");
    for id in 0..8 {
        assert_eq!(lb.conns(id).opened, SATURATED_INFLIGHT, "backend {id}");
    }
    // Every fast one saturated (score 25 × 10^8): an idle slow one (10^9)
    // beats them, one with a flow (4 × 10^9) does not.
    let next = choices_from(&lb, fill, 2);
    assert!(next.iter().all(|&id| id >= 8), "{next:?}");
    assert_ne!(next[0], next[1]);
    let more = choices_from(&lb, fill + 2, 200);
    let slow = more.iter().filter(|&&id| id >= 8).count();
    println!("slow picks after saturation: 2 + {slow} of 200");
    assert!((5..100).contains(&slow), "{slow}");
    // `--p2c-saturation 0`: the bound keeps the slow pair out however
    // busy the fast ones are.
    let mut lb = hetero_p2c();
    set_reference(&mut lb, 100_000_000);
    edit_vip(&mut lb, |meta| {
        meta.p2c_full_scan = 16;
        meta.p2c_saturation = 0;
    });
    let off = choices(&lb, fill + 40);
    assert!(off.iter().all(|&id| id < 8), "saturation off: {off:?}");
    // A backend the control plane holds (SCORE_FAR_ABOVE) is far above
    // whatever its cost: with the slow pair held at the fast ones' cost,
    // fresh flows still fill the fast ones first.
    let mut lb = hetero_p2c();
    set_reference(&mut lb, 100_000_000);
    edit_vip(&mut lb, |meta| meta.p2c_full_scan = 16);
    for id in 8..10 {
        lb.set_score(
            id,
            BackendScore {
                ewma_ns: 3_600_000_000_000,
                cost: 100_000_000,
                weight: 1,
                flags: SCORE_FAR_ABOVE,
                ..BackendScore::default()
            },
        );
    }
    let first = choices(&lb, fill);
    assert!(first.iter().all(|&id| id < 8), "held: {first:?}");
    // Once the fast ones are saturated, a held one competes as if it had
    // the threshold's flows in flight on top of its own: at the fast ones'
    // cost, like a fast one with that many more. So the next flows spread
    // over all ten, the held pair about 2 in 10 (3 of 16). Counted as
    // idle, the held pair took the first 8 after the fill.
    let next = choices_from(&lb, fill, 16);
    let slow_first = next.iter().filter(|&&id| id >= 8).count();
    assert!(
        slow_first <= 5,
        "held at the fast cost, then saturated: {slow_first} of 16: {next:?}"
    );
    let more = choices_from(&lb, fill + 16, 24);
    let slow = slow_first + more.iter().filter(|&&id| id >= 8).count();
    assert!(
        (4..=14).contains(&slow),
        "held at the fast cost, then saturated: {slow} of 40: {next:?} {more:?}"
    );
}

fn p2c_avoids_a_backend_whose_oldest_request_is_stuck() {
    let stalled = |stalled_for_ns: u64| {
        let mut lb = setup(Algorithm::P2cEwma, &[1, 1], 0, 0);
        lb.set_opened(0, 1);
        lb.set_opened(1, 1);
        let now = monotonic_ns();
        set_progress(&mut lb, 0, now - stalled_for_ns);
        set_progress(&mut lb, 1, now);
        shares(&choices(&lb, 20), 2)
    };
    // Backend 0 has not answered for 10 s; its EWMA is 1 ms, so the stall
    // threshold is the 10 ms floor and its cost is ×1000: 20 new flows all
    // go to backend 1.
    assert_eq!(stalled(10_000_000_000), [0.0, 1.0]);
    // A gap within the floor is no stall: both get flows.
    let fresh = stalled(100_000);
    assert!(fresh[0] > 0.2 && fresh[1] > 0.2, "{fresh:?}");
    // Silent for 10 s with a flow open but nothing asked since its last
    // answer (an idle keep-alive connection, an answered UDP flow): no
    // stall either.
    let mut lb = setup(Algorithm::P2cEwma, &[1, 1], 0, 0);
    lb.set_opened(0, 1);
    lb.set_opened(1, 1);
    let now = monotonic_ns();
    let quiet = BackendProgress {
        answered_ns: now - 10_000_000_000,
        requested_ns: now - 10_000_000_001,
    };
    lb.set_progress(0, quiet);
    set_progress(&mut lb, 1, now);
    let idle_open = shares(&choices(&lb, 20), 2);
    assert!(idle_open[0] > 0.2 && idle_open[1] > 0.2, "{idle_open:?}");
}

/// One-way traffic (syslog over UDP): no backend ever answers, so each
/// one's stall clock runs from its first request for good. Backend 0 got
/// its first minutes ago, backend 1 (added later) 11 s ago, and backend 1
/// has more flows in flight. A new request moves no clock (a paused
/// server's clients send those too); a client that keeps sending while its
/// request waits, a second later, moves backend 0's up to the cap (10 s).
/// The two then carry about the same factor and load decides: backend 0
/// takes new flows until its count catches up. Uncapped, minutes against
/// 11 s made backend 0 cost several times more than backend 1's 25/9
/// in-flight term, and backend 1 took all of them.
fn p2c_balances_never_answered_backends_by_load() {
    let mut lb = setup(Algorithm::P2cEwma, &[1, 1], 0, 0);
    // A flow on backend 0 (both are idle: a fair draw).
    let on_zero = (0..64)
        .map(client)
        .find(|&(addr, port)| syn_from(&lb, addr, port) == 0)
        .expect("a flow on backend 0 in 64 draws");
    let now = monotonic_ns();
    // The stamps are on the kernel's clock, which starts at boot.
    let first = (now - 1).min(400_000_000_000);
    assert!(
        first > 60_000_000_000,
        "needs a machine up for over a minute (its clock reads {now} ns)"
    );
    set_progress(&mut lb, 0, now - first);
    set_progress(&mut lb, 1, now - 11_000_000_000);
    let age = |lb: &Lb| monotonic_ns() - lb.progress(0).stall_clock();
    let datagram = |lb: &mut Lb| {
        let request = Pkt::tcp(on_zero, (VIP, HTTP), TCP_ACK | TCP_PSH).payload(b"<14>one-way\n");
        let (action, _) = lb.run(&request.build());
        assert_eq!(action, XDP_TX, "{:?}", lb.reasons());
    };
    datagram(&mut lb);
    assert!(age(&lb) >= first, "a new request moves no clock");
    // Past the flow's refresh check (100 jiffies: at most a second).
    std::thread::sleep(std::time::Duration::from_millis(1_200));
    datagram(&mut lb);
    let capped = age(&lb);
    assert!(
        (10_000_000_000..11_000_000_000).contains(&capped),
        "capped at 10 s: {capped} ns"
    );
    lb.set_opened(0, 2);
    lb.set_opened(1, 4);
    let chosen = choices_from(&lb, 64, 20);
    let got = shares(&chosen, 2);
    assert!(got[0] >= 0.4, "by load: {got:?} {chosen:?}");
    assert_eq!(chosen[..2], [0, 0], "the one with fewer in flight first");
}

/// With `p2c_full_scan` at least the VIP's backend count, every backend is
/// compared, not two random ones: the one idle backend among nine busy ones
/// wins every new flow (a random pair holds it 2 times in 10); a limit below
/// the count draws pairs again. An idle backend far above the re-draw bound
/// still loses to busy ones within it.
fn p2c_full_scan_compares_every_backend() {
    // Backend 7 idle, the others with 3 open flows each; reset before every
    // SYN so that each new flow sees the same pool.
    let picks = |full_scan: u16, slow_idle: bool| {
        let mut lb = setup(Algorithm::P2cEwma, &[1; 10], 0, 0);
        edit_vip(&mut lb, |meta| meta.p2c_full_scan = full_scan);
        if slow_idle {
            set_reference(&mut lb, 100_000_000);
            let score = BackendScore {
                ewma_ns: 1_000_000,
                cost: 1_000_000_000,
                weight: 1,
                ..BackendScore::default()
            };
            lb.set_score(7, score);
        }
        (0..40)
            .filter(|&i| {
                for id in 0..10 {
                    lb.set_opened(id, if id == 7 { 0 } else { 3 });
                }
                let (addr, port) = client(i);
                syn_from(&lb, addr, port) == 7
            })
            .count()
    };
    assert_eq!(picks(10, false), 40, "full scan over 10 backends");
    assert_eq!(picks(16, false), 40, "limit above the count");
    let paired = picks(9, false);
    println!("idle backend's picks of 40: full scan 40, pairs {paired}");
    assert!((1..=24).contains(&paired), "pairs: {paired} of 40");
    assert_eq!(picks(10, true), 0, "an idle backend far above the bound");
}

/// A quiet small pool (every backend idle at each new flow, estimates a
/// few percent apart, as after a light run) keeps P2C's pair under a full
/// scan: the pair's idle winner settles the pick, so the lowest estimate
/// wins about 2/3 of new flows of three backends, not all of them (which
/// the scan's best alone did: 390 of 400 connections in the IPv6 lab).
fn p2c_full_scan_keeps_the_pairs_spread_in_a_quiet_pool() {
    let mut lb = setup(Algorithm::P2cEwma, &[1; 3], 0, 0);
    edit_vip(&mut lb, |meta| meta.p2c_full_scan = 16);
    set_reference(&mut lb, 10_500_000);
    for (id, ns) in [(0, 8_000_000), (1, 10_500_000), (2, 12_000_000)] {
        let score = BackendScore {
            ewma_ns: ns,
            cost: ns,
            weight: 1,
            ..BackendScore::default()
        };
        lb.set_score(id, score);
    }
    let mut picks = [0u32; 3];
    for i in 0..90 {
        for id in 0..3 {
            lb.set_opened(id, 0);
        }
        let (addr, port) = client(i);
        picks[syn_from(&lb, addr, port) as usize] += 1;
    }
    println!("quiet pool of three, full scan on: {picks:?} of 90");
    // Pairs: 60 / 30 / 0 expected.
    assert!((40..=78).contains(&picks[0]), "{picks:?}");
    assert!(picks[1] >= 12, "{picks:?}");
    assert_eq!(
        picks[2], 0,
        "the highest estimate loses every pair: {picks:?}"
    );
    // Busy pool: the first two with a flow in flight each, the third
    // idle: every pair's winner is busy or is the idle one, so the idle
    // one takes every flow.
    let mut idle = 0;
    for i in 0..30 {
        lb.set_opened(0, 1);
        lb.set_opened(1, 1);
        lb.set_opened(2, 0);
        let (addr, port) = client(100 + i);
        idle += u32::from(syn_from(&lb, addr, port) == 2);
    }
    assert_eq!(
        idle, 30,
        "the idle backend, found by the scan when the pair missed it"
    );
}

/// Equal ranks in the full scan are shared out evenly. Eight equal
/// backends, the first two idle, the other six busy: a pair of two busy
/// ones (15 pairs in 28) leaves the pick to the scan, which finds the two
/// idle ones tied. A random start alone gave each tied slot the gap before
/// it: slot 0 won 7 scans in 8 (about 70 % of all flows, against 50 %).
fn p2c_full_scan_shares_tied_ranks_out_evenly() {
    let mut lb = setup(Algorithm::P2cEwma, &[1; 8], 0, 0);
    edit_vip(&mut lb, |meta| meta.p2c_full_scan = 16);
    for id in 0..8 {
        let score = BackendScore {
            ewma_ns: 2_000_000,
            cost: 2_000_000,
            weight: 1,
            ..BackendScore::default()
        };
        lb.set_score(id, score);
    }
    let mut picks = [0u32; 8];
    for i in 0..800 {
        for id in 0..8 {
            lb.set_opened(id, if id < 2 { 0 } else { 3 });
        }
        let (addr, port) = client(i);
        picks[syn_from(&lb, addr, port) as usize] += 1;
    }
    println!("two idle among eight, full scan on: {picks:?} of 800");
    assert_eq!(
        picks[0] + picks[1],
        800,
        "an idle one every time: {picks:?}"
    );
    // 400 each expected; 320..=480 is beyond five standard deviations.
    assert!((320..=480).contains(&picks[0]), "{picks:?}");
}

/// Kernel time per new flow (a SYN through select, flow creation and NAT),
/// from BPF_PROG_TEST_RUN's duration, for each algorithm over ten backends.
/// P2C is measured plain and with its tail features working on every flow
/// (every pick redrawn twice, stall ages present).
fn time_per_new_flow() {
    const RUNS: u32 = 2000;
    let mean_ns = |lb: &Lb| {
        let total: u64 = (0..RUNS)
            .map(|i| {
                let (addr, port) = client(i);
                let frame = Pkt::tcp((addr, port), (VIP, HTTP), TCP_SYN).build();
                let (action, _, ns) = lb.run_repeat(&frame, 1);
                assert_eq!(action, XDP_TX);
                u64::from(ns)
            })
            .sum();
        total / u64::from(RUNS)
    };
    let mut rows = Vec::new();
    for algorithm in ALGORITHMS {
        let lb = setup(algorithm, &[1; 10], 0, 0);
        rows.push((algorithm.name().to_string(), mean_ns(&lb)));
    }
    let mut lb = setup(Algorithm::P2cEwma, &[1; 10], 0, 0);
    set_reference(&mut lb, 1);
    let now = monotonic_ns();
    for id in 0..10 {
        lb.set_opened(id, 1);
        set_progress(&mut lb, id, now - 50_000_000);
    }
    rows.push(("p2c-ewma, re-draws + stall ages".into(), mean_ns(&lb)));
    let mut lb = setup(Algorithm::P2cEwma, &[1; 10], 0, 0);
    edit_vip(&mut lb, |meta| meta.p2c_full_scan = 16);
    rows.push(("p2c-ewma, full scan of 10".into(), mean_ns(&lb)));
    for (name, ns) in &rows {
        println!("new flow, {name}: {ns} ns");
        assert!(*ns < 100_000, "{name}: {ns} ns per new flow");
    }
}

/// The cases that need nothing but one program, by name.
const CASES: &[(&str, fn())] = &[
    (
        "wrr_follows_the_smooth_schedule",
        wrr_follows_the_smooth_schedule,
    ),
    ("round_robin_ignores_weights", round_robin_ignores_weights),
    (
        "least_conn_picks_the_fewest_per_weight",
        least_conn_picks_the_fewest_per_weight,
    ),
    (
        "least_conn_breaks_ties_by_the_work_already_done",
        least_conn_breaks_ties_by_the_work_already_done,
    ),
    (
        "p2c_full_scan_breaks_ties_by_the_work_already_done",
        p2c_full_scan_breaks_ties_by_the_work_already_done,
    ),
    (
        "maglev_uses_the_control_planes_table",
        maglev_uses_the_control_planes_table,
    ),
    (
        "maglev_source_affinity_keeps_a_client_on_one_backend",
        maglev_source_affinity_keeps_a_client_on_one_backend,
    ),
    (
        "p2c_redraws_when_both_draws_are_far_above_the_pool",
        p2c_redraws_when_both_draws_are_far_above_the_pool,
    ),
    (
        "p2c_admits_far_above_backends_once_the_others_are_saturated",
        p2c_admits_far_above_backends_once_the_others_are_saturated,
    ),
    (
        "p2c_avoids_a_backend_whose_oldest_request_is_stuck",
        p2c_avoids_a_backend_whose_oldest_request_is_stuck,
    ),
    (
        "p2c_balances_never_answered_backends_by_load",
        p2c_balances_never_answered_backends_by_load,
    ),
    (
        "p2c_full_scan_compares_every_backend",
        p2c_full_scan_compares_every_backend,
    ),
    (
        "p2c_full_scan_keeps_the_pairs_spread_in_a_quiet_pool",
        p2c_full_scan_keeps_the_pairs_spread_in_a_quiet_pool,
    ),
    (
        "a_restart_keeps_a_dropped_maglev_vips_table_until_it_is_removed",
        a_restart_keeps_a_dropped_maglev_vips_table_until_it_is_removed,
    ),
    (
        "p2c_full_scan_shares_tied_ranks_out_evenly",
        p2c_full_scan_shares_tied_ranks_out_evenly,
    ),
    ("time_per_new_flow", time_per_new_flow),
    (
        "wrr_tables_are_swapped_not_rewritten_in_place",
        wrr_tables_are_swapped_not_rewritten_in_place,
    ),
    (
        "random_sums_are_swapped_not_rewritten_in_place",
        random_sums_are_swapped_not_rewritten_in_place,
    ),
    (
        "p2c_bound_does_not_hold_a_light_weight_out",
        p2c_bound_does_not_hold_a_light_weight_out,
    ),
];

fn main() {
    let mut trials: Vec<_> = CASES
        .iter()
        .map(|&(name, case)| packet_case(name, case))
        .collect();
    for (algorithm, tolerance, bias) in WEIGHTED {
        let name = format!("weighted_distribution::{}", slug(algorithm.name()));
        trials.push(packet_case(name, move || {
            weighted_distribution(algorithm, tolerance, bias);
        }));
    }
    for algorithm in ALGORITHMS {
        let name = format!(
            "out_of_service_backends_are_never_chosen::{}",
            slug(algorithm.name())
        );
        trials.push(packet_case(name, move || {
            out_of_service_backends_are_never_chosen(algorithm);
        }));
    }
    trials.push(plain_case(
        "tables_cover_the_limits",
        tables_cover_the_limits,
    ));
    trials::run("algorithms", trials)
}
