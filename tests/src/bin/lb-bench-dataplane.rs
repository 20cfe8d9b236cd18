//! `cargo xtask bench dataplane`: the cost per packet of the XDP program,
//! measured with `BPF_PROG_TEST_RUN` against two baselines measured in the
//! same run on the same CPU: a bare XDP_PASS program and a MAC-swap XDP_TX
//! program. Every run uses repeat=1 (a rewritten frame must not be fed back
//! to the program, as Katran's benchmark also does), and the per-packet
//! cost is the median of the kernel-reported durations. A benchmark, not a
//! test: it prints a table and asserts nothing about time.
//!
//! Each case also runs in blocks, each right after a block of the MAC-swap
//! baseline of the same size: the paired ratio is the median of the blocks'
//! ratios (with their range), so a VM whose speed drifts during the run
//! moves both sides of each ratio alike.
//!
//! A new flow's cost depends on the flow table it lands in, so every
//! new-flow row and floor starts from one stated table: one established
//! connection's entries, in a table churned right before the row as a
//! running balancer's is (filled whole and emptied, so the elements it
//! hands out lie scattered, see `churn`). The time-wait row adds its own
//! closed connections; two rows fill half the table first; and one row is
//! measured before any churn, on the table as loaded.
//!
//! A calibration row, the MAC swap after a few calls of an empty BPF
//! function, gives what one call and its return cost on the machine: every
//! stage boundary of `lb_xdp` pays it, and where the kernel mitigates
//! return-stack attacks with a return thunk (SRSO) it is not small.
use std::net::Ipv4Addr;

use anyhow::{Result, bail};
use clap::Parser;
use lb_common::{
    Algorithm, BACKEND_ACTIVE, CALIBRATION_CALLS, FLOOR_FLOW_WAYS, FLOOR_FLOW_WAYS_MAP,
    FLOOR_REPLY_WAYS_MAP, FlowEntry, FlowKey, IPPROTO_TCP,
};
use lb_lab::xdp::{
    harness::*,
    isolate::run_isolated,
    packet::{Pkt, TCP_ACK, TCP_FIN, TCP_PSH, TCP_SYN, linux_syn_options, segment_options},
};

/// Baseline programs in the eBPF object.
const PASS_PROGRAM: &str = "xdp_pass_stub";
const MACSWAP_PROGRAM: &str = "xdp_macswap_bench";
/// The MAC swap after this many calls of an empty BPF function
/// (lb-ebpf's `xdp_calls_bench`): the price of one call and its return,
/// which every stage boundary of `lb_xdp` pays.
const CALLS_PROGRAM: &str = "xdp_calls_bench";
const CALIBRATION_CASE: &str = "calibration: 4 calls + MAC swap";
const _: () = assert!(CALIBRATION_CALLS == 4, "CALIBRATION_CASE names the count");
/// New-flow floors in the eBPF object (lb-ebpf/src/floor.rs): a flow-table
/// miss and one or two inserts, then a MAC swap. Their client addresses
/// follow the new-flow cases' (10.(64 + case).x.y), so no key meets another.
/// The third is the floor of a layout with one hash entry per connection
/// and the reply direction in an array of ways indexed by the SNAT tuple;
/// the fourth that of a table with no hash entry: the forward direction
/// too a way, at a slot the program hashes its key to.
const FLOORS: [(&str, &str); 4] = [
    ("floor: new flow, 1 table entry", "xdp_floor_one_entry"),
    ("floor: new flow, 2 table entries", "xdp_floor_two_entries"),
    (
        "floor: new flow, 1 entry + reply way",
        "xdp_floor_one_entry_way",
    ),
    ("floor: new flow, 2 ways, no entry", "xdp_floor_two_ways"),
];
/// Floors of an established packet (lb-ebpf/src/floor.rs): its flow
/// lookup as `lb_xdp` does it (a hash-map hit in IPv4's table, `FLOWS4`,
/// 16-byte keys packed from the parsed key), and as a way of an array at a
/// slot the program hashes the key to, then a MAC swap. They run the
/// established client -> backend frame.
const ESTABLISHED_FLOORS: [(&str, &str); 2] = [
    (
        "floor: established, hash-map hit",
        "xdp_floor_established_hash",
    ),
    (
        "floor: established, array way hit",
        "xdp_floor_established_way",
    ),
];
/// Ways of the one-entry floor's reply array (16 bytes each): more than
/// the new flows of a run, so its claims never wrap onto a taken way.
const BENCH_REPLY_WAYS: u32 = 1 << 20;
/// Backend counts of the new-flow cases (each its own VIP and port).
const P2C_SIZES: [u32; 3] = [2, 64, 1024];
const FIRST_P2C_PORT: u16 = 81;
/// A pool as large as P2C's default full scan (`--p2c-full-scan 16`), the
/// largest that least-connections relief applies to
/// (`lb_user::publish::relief`): a new flow there under P2C and under least
/// connections, on ports of their own after the P2C sizes'.
const SCAN_POOL: u32 = 16;
const SCAN_CASES: [(Algorithm, &str); 2] = [
    (Algorithm::P2cEwma, "P2C"),
    (Algorithm::LeastConn, "least connections"),
];
/// Flow table big enough that the new-flow cases never evict.
const BENCH_FLOW_TABLE: u32 = 1 << 19;
/// The ring buffer is drained this often, so new flows keep emitting events
/// as in production instead of counting them lost.
const DRAIN_EVERY: usize = 1000;
/// New flows per P2C case, and the SNAT port range: with 2 backends each
/// gets about half of the flows, which keeps every backend's port space at
/// most a sixth full, so the claim's cursor finds a free tuple at its first
/// step and the case measures a claim, not a search.
const NEW_FLOWS: usize = 20_000;
const BENCH_SNAT_PORTS: (u16, u16) = (1024, 65_535);
/// The case of a slice turned over inside the quarantine: every SNAT tuple
/// of its backend is held by a closed connection whose backend holds it in
/// TIME_WAIT, and each new SYN takes one over (time-wait reuse, as under a
/// sustained rate above addresses × ports ÷ quarantine). Its backend is
/// the first id after the P2C pools', behind a VIP of its own, with the
/// client blocks after the other cases'.
const TURNED_OVER_CASE: &str = "new flow, every tuple in time wait";
const TURNED_OVER_BACKEND: u32 = P2C_SIZES[2];
const TURNED_OVER_VIP_PORT: u16 = FIRST_P2C_PORT + (P2C_SIZES.len() + SCAN_CASES.len()) as u16;
/// Client blocks (10.(64 + block).x.y) of the closed connections and of
/// the measured SYNs.
const TURNED_OVER_CLOSED_CLIENTS: usize = P2C_SIZES.len() + FLOORS.len() + SCAN_CASES.len();
const TURNED_OVER_NEW_CLIENTS: usize = TURNED_OVER_CLOSED_CLIENTS + 1;
/// Sequence number and TSval of the closed connections' SYNs.
const CLOSED_SYN: (u32, u32) = (1_000, 1_000);
/// Sequence number and TSval of the closed connections' client FINs, and of
/// the SYNs that take their tuples over (newer: the backend accepts them).
const CLOSED_FIN: (u32, u32) = (5_000, 2_000);
const TAKING_SYN: (u32, u32) = (10, 3_000);
/// The suffix of the rows measured on a table half full ([`fill_to`]),
/// and their client blocks (after the turned-over case's).
const HALF_FULL: &str = ", table half full";
const HALF_FULL_CLIENTS: usize = TURNED_OVER_NEW_CLIENTS + 1;
/// The suffix of the row measured on the table as loaded, before `churn`,
/// and its client block.
const FRESH: &str = ", fresh table";
const FRESH_CLIENTS: usize = HALF_FULL_CLIENTS + 2;
/// The half-full table's own entries: clients from 10.200.0.0 up (past
/// every case's block), to this VIP port, which no VIP serves.
const FILL_CLIENTS: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 0);
const FILL_VIP_PORT: u16 = 9;
/// Sequence number and TSval of the other cases' SYNs (every new flow's
/// SYN carries a Linux SYN's options, which the program reads when
/// time-wait reuse is on, as it is here).
const NEW_SYN: (u32, u32) = (1, 1_000);
/// Payload of the established-flow packets (a small request or response).
const PAYLOAD: &[u8] = &[b'x'; 64];

#[derive(Parser)]
#[command(about = "Per-packet cost of lb_xdp through BPF_PROG_TEST_RUN")]
struct Args {
    /// Runs per case (each a separate BPF_PROG_TEST_RUN with repeat=1).
    #[arg(long, default_value_t = 100_000)]
    runs: usize,
    /// Measure only the cases whose name contains this text (the two
    /// baselines are always measured), e.g. `established` or `new flow`.
    #[arg(long)]
    only: Option<String>,
    /// Blocks per case for the paired ratio (each block of the case right
    /// after one of the MAC-swap baseline).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=1000))]
    blocks: u32,
}

/// One measured case.
struct Row {
    name: String,
    /// Median and mean kernel-reported ns per packet.
    median_ns: u32,
    mean_ns: f64,
    /// The case's blocks against the MAC-swap blocks run right before them
    /// (none for the baselines themselves).
    paired: Option<PairedRatio>,
}

/// Median, lowest and highest of the blocks' ratios (case median ÷ MAC-swap
/// median of the block before it).
struct PairedRatio {
    median: f64,
    min: f64,
    max: f64,
}

impl PairedRatio {
    fn of(mut ratios: Vec<f64>) -> Option<Self> {
        ratios.sort_by(f64::total_cmp);
        Some(Self {
            median: *ratios.get(ratios.len() / 2)?,
            min: *ratios.first()?,
            max: *ratios.last()?,
        })
    }
}

/// How a case is measured: its program, its frames (taken round robin), how
/// many runs, and the action each must give.
struct Case<'a> {
    name: &'a str,
    program: &'a str,
    frames: &'a [Vec<u8>],
    runs: usize,
    action: u32,
}

/// The MAC-swap blocks a case is paired with.
struct Pairing<'a> {
    frame: &'a [u8],
    blocks: usize,
}

fn main() -> Result<()> {
    let args = Args::parse();
    if !lb_lab::root::is_root() {
        bail!("BPF_PROG_TEST_RUN needs root");
    }
    if args.runs == 0 {
        bail!("--runs must be at least 1");
    }
    if args.runs < args.blocks as usize {
        bail!("--runs must be at least --blocks ({})", args.blocks);
    }
    let only = args.only.clone();
    let rows = run_isolated(move || bench(args.runs, args.blocks as usize, only.as_deref()));
    print_table(&rows);
    Ok(())
}

fn bench(runs: usize, blocks: usize, only: Option<&str>) -> Vec<Row> {
    let wanted = |name: &str| only.is_none_or(|text| name.contains(text));
    let mut lb = Lb::load_sized(
        lb_lab::production::EBPF_OBJECT,
        BENCH_FLOW_TABLE,
        &[
            (FLOOR_REPLY_WAYS_MAP, BENCH_REPLY_WAYS),
            (FLOOR_FLOW_WAYS_MAP, FLOOR_FLOW_WAYS),
        ],
    );
    lb.load_program(PASS_PROGRAM);
    lb.load_program(MACSWAP_PROGRAM);
    lb.load_program(CALLS_PROGRAM);
    for (_, program) in FLOORS.iter().chain(&ESTABLISHED_FLOORS) {
        lb.load_program(program);
    }
    lb.config(true, BENCH_SNAT_PORTS.0, BENCH_SNAT_PORTS.1);
    // As lb-user runs by default (`--snat-time-wait-reuse on`): a SYN's
    // options are read for its claim.
    lb.time_wait_reuse(true);
    let max = *P2C_SIZES.iter().max().expect("sizes");
    for id in 0..max {
        lb.backend(id, BACKEND_ACTIVE);
        lb.set_cost(id, 1_000_000);
    }
    lb.vip(0, HTTP, IPPROTO_TCP, Algorithm::P2cEwma, 0, &[0]);
    for (i, n) in P2C_SIZES.iter().enumerate() {
        let ids: Vec<u32> = (0..*n).collect();
        lb.vip(
            1 + i as u32,
            FIRST_P2C_PORT + i as u16,
            IPPROTO_TCP,
            Algorithm::P2cEwma,
            0,
            &ids,
        );
    }

    let scan_ids: Vec<u32> = (0..SCAN_POOL).collect();
    for (j, (algorithm, _)) in SCAN_CASES.iter().enumerate() {
        lb.vip(
            1 + (P2C_SIZES.len() + j) as u32,
            scan_port(j),
            IPPROTO_TCP,
            *algorithm,
            0,
            &scan_ids,
        );
        // P2C compares the whole pool, as the control plane configures it
        // by default (the other P2C cases draw pairs).
        lb.edit_vip(scan_port(j), |meta| meta.p2c_full_scan = SCAN_POOL as u16);
    }

    let syn = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_SYN);
    assert_eq!(lb.run(&syn.build()).0, XDP_TX, "open the established flow");
    let fwd = lb.forward_entry(IPPROTO_TCP, HTTP, CLIENT_PORT);
    let snat_port = u16::from_be(fwd.new_sport);
    let request = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, HTTP), TCP_ACK | TCP_PSH)
        .payload(PAYLOAD)
        .build();
    let response = from_backend(0, snat_port, TCP_ACK | TCP_PSH)
        .payload(PAYLOAD)
        .build();
    let miss = Pkt::tcp((CLIENT, CLIENT_PORT), (VIP, 443), TCP_ACK)
        .payload(PAYLOAD)
        .build();

    let pairing = Pairing {
        frame: &request,
        blocks,
    };
    let mut rows = vec![
        measure(
            &mut lb,
            &Case {
                name: "baseline: XDP_PASS",
                program: PASS_PROGRAM,
                frames: std::slice::from_ref(&request),
                runs,
                action: XDP_PASS,
            },
            None,
        ),
        measure(
            &mut lb,
            &Case {
                name: "baseline: MAC swap + XDP_TX",
                program: MACSWAP_PROGRAM,
                frames: std::slice::from_ref(&request),
                runs,
                action: XDP_TX,
            },
            None,
        ),
    ];
    rows.push(measure(
        &mut lb,
        &Case {
            name: CALIBRATION_CASE,
            program: CALLS_PROGRAM,
            frames: std::slice::from_ref(&request),
            runs,
            action: XDP_TX,
        },
        Some(&pairing),
    ));
    for (name, frame) in [
        ("established, client -> backend", &request),
        ("established, backend -> client", &response),
    ] {
        if wanted(name) {
            let case = Case {
                name,
                program: lb_common::XDP_PROGRAM,
                frames: std::slice::from_ref(frame),
                runs,
                action: XDP_TX,
            };
            rows.push(measure(&mut lb, &case, Some(&pairing)));
        }
    }
    for (name, program) in ESTABLISHED_FLOORS {
        if wanted(name) {
            let case = Case {
                name,
                program,
                frames: std::slice::from_ref(&request),
                runs,
                action: XDP_TX,
            };
            rows.push(measure(&mut lb, &case, Some(&pairing)));
        }
    }
    // Every new-flow row starts from the tables as they are here, the
    // established flow's two entries, churned again right before it (see
    // `churn`), so each draws the same kind of free elements: run one after
    // another on one table, a case met the earlier cases' entries in its
    // buckets' chains and read dearer the later it ran. The half-full rows
    // then fill half the table; the fresh row runs first, before any churn.
    let base: Vec<FlowKey> = lb.all_flows().into_iter().map(|(key, _)| key).collect();
    for case in new_flow_cases() {
        if !wanted(&case.name) {
            continue;
        }
        match case.table {
            Table::AsLoaded => {}
            Table::Churned => churn(&mut lb, fwd, &base),
            Table::HalfFull => {
                churn(&mut lb, fwd, &base);
                fill_to(&mut lb, (BENCH_FLOW_TABLE / 2) as usize, fwd);
            }
        }
        let flows = runs.min(NEW_FLOWS);
        let frames = new_flow_frames(case.port, case.clients, flows, NEW_SYN);
        let measured = Case {
            name: &case.name,
            program: case.program,
            frames: &frames,
            runs: flows,
            action: XDP_TX,
        };
        rows.push(measure(&mut lb, &measured, Some(&pairing)));
    }
    if wanted(TURNED_OVER_CASE) {
        churn(&mut lb, fwd, &base);
        rows.push(turned_over(&mut lb, runs.min(NEW_FLOWS), &pairing));
    }
    let name = "miss (not VIP traffic)";
    if wanted(name) {
        let case = Case {
            name,
            program: lb_common::XDP_PROGRAM,
            frames: std::slice::from_ref(&miss),
            runs,
            action: XDP_PASS,
        };
        rows.push(measure(&mut lb, &case, Some(&pairing)));
    }
    rows
}

/// [`TURNED_OVER_CASE`]: `flows` connections to its backend on exactly
/// `flows` SNAT ports, each closed by the backend first, with the client's
/// FIN acknowledged (the backend holds every tuple in TIME_WAIT), then
/// `flows` SYNs with a newer timestamp, measured, each taking over the tuple
/// at the claim's cursor. Runs last: it narrows the SNAT range.
fn turned_over(lb: &mut Lb, flows: usize, pairing: &Pairing) -> Row {
    let first_port = BENCH_SNAT_PORTS.0;
    let last_port = u16::try_from(usize::from(first_port) + flows - 1).expect("ports");
    // (`config` resets the flags.)
    lb.config(true, first_port, last_port);
    lb.time_wait_reuse(true);
    lb.backend(TURNED_OVER_BACKEND, BACKEND_ACTIVE);
    lb.set_cost(TURNED_OVER_BACKEND, 1_000_000);
    lb.vip(
        1 + (P2C_SIZES.len() + SCAN_CASES.len()) as u32,
        TURNED_OVER_VIP_PORT,
        IPPROTO_TCP,
        Algorithm::P2cEwma,
        0,
        &[TURNED_OVER_BACKEND],
    );
    for i in 0..flows {
        let client = client_of(TURNED_OVER_CLOSED_CLIENTS, i);
        // One CPU slice, one address: the cursor hands out the ports in order.
        let port = first_port + i as u16;
        let syn = syn_frame(client, TURNED_OVER_VIP_PORT, CLOSED_SYN);
        let fin = Pkt::tcp(
            (client, CLIENT_PORT),
            (VIP, TURNED_OVER_VIP_PORT),
            TCP_FIN | TCP_ACK,
        )
        .seq(CLOSED_FIN.0)
        .tcp_options(&segment_options(CLOSED_FIN.1))
        .build();
        let frames = [
            (syn, "its SYN"),
            (
                from_backend(TURNED_OVER_BACKEND, port, TCP_FIN | TCP_ACK).build(),
                "the backend's FIN",
            ),
            (fin, "the client's FIN"),
            (
                from_backend(TURNED_OVER_BACKEND, port, TCP_ACK)
                    .ack(CLOSED_FIN.0.wrapping_add(1))
                    .build(),
                "the backend's ACK of it",
            ),
        ];
        for (frame, what) in frames {
            run_one(lb, lb_common::XDP_PROGRAM, what, &frame, i, XDP_TX);
        }
    }
    assert_eq!(
        lb.snat_used(TURNED_OVER_BACKEND),
        flows as u64,
        "every tuple held by a closed connection"
    );
    let taking = new_flow_frames(
        TURNED_OVER_VIP_PORT,
        TURNED_OVER_NEW_CLIENTS,
        flows,
        TAKING_SYN,
    );
    let case = Case {
        name: TURNED_OVER_CASE,
        program: lb_common::XDP_PROGRAM,
        frames: &taking,
        runs: flows,
        action: XDP_TX,
    };
    let row = measure(lb, &case, Some(pairing));
    assert_eq!(
        lb.snat_used(TURNED_OVER_BACKEND),
        flows as u64,
        "every tuple taken over, none freed or added"
    );
    row
}

/// The VIP port of `SCAN_CASES[j]`.
fn scan_port(j: usize) -> u16 {
    FIRST_P2C_PORT + (P2C_SIZES.len() + j) as u16
}

/// The name of the new-flow case over `backends`.
fn new_flow_case(backends: u32) -> String {
    format!("new flow, P2C over {backends} backends")
}

/// A new-flow row: `runs` SYNs, each from its own client of block
/// `clients`, to the VIP on `port`, through `program` (`lb_xdp` or a
/// floor), on the table `table`.
struct NewFlowCase {
    name: String,
    program: &'static str,
    port: u16,
    clients: usize,
    table: Table,
}

/// The flow table a new-flow row starts from (besides the established
/// flow's two entries).
#[derive(Clone, Copy)]
enum Table {
    /// As loaded: no element ever freed. Only before any churn.
    AsLoaded,
    /// Churned right before the row (see `churn`).
    Churned,
    /// Churned, then half filled (see `fill_to`).
    HalfFull,
}

/// Every new-flow row, in the order they run and print: the fresh-table
/// row, `lb_xdp`'s cases, the floors, then the half-full rows.
fn new_flow_cases() -> Vec<NewFlowCase> {
    // First: the one row on the table as loaded, before any churn.
    let mut cases = vec![NewFlowCase {
        name: format!("{}{FRESH}", new_flow_case(P2C_SIZES[2])),
        program: lb_common::XDP_PROGRAM,
        port: FIRST_P2C_PORT + 2,
        clients: FRESH_CLIENTS,
        table: Table::AsLoaded,
    }];
    for (i, n) in P2C_SIZES.iter().enumerate() {
        cases.push(NewFlowCase {
            name: new_flow_case(*n),
            program: lb_common::XDP_PROGRAM,
            port: FIRST_P2C_PORT + i as u16,
            clients: i,
            table: Table::Churned,
        });
    }
    for (j, (_, label)) in SCAN_CASES.iter().enumerate() {
        cases.push(NewFlowCase {
            name: format!("new flow, {label} over {SCAN_POOL} backends"),
            program: lb_common::XDP_PROGRAM,
            port: scan_port(j),
            clients: P2C_SIZES.len() + FLOORS.len() + j,
            table: Table::Churned,
        });
    }
    for (i, (name, program)) in FLOORS.iter().enumerate() {
        cases.push(NewFlowCase {
            name: (*name).to_string(),
            program,
            port: HTTP,
            clients: P2C_SIZES.len() + i,
            table: Table::Churned,
        });
    }
    cases.push(NewFlowCase {
        name: format!("{}{HALF_FULL}", new_flow_case(P2C_SIZES[2])),
        program: lb_common::XDP_PROGRAM,
        port: FIRST_P2C_PORT + 2,
        clients: HALF_FULL_CLIENTS,
        table: Table::HalfFull,
    });
    cases.push(NewFlowCase {
        name: format!("{}{HALF_FULL}", FLOORS[1].0),
        program: FLOORS[1].1,
        port: HTTP,
        clients: HALF_FULL_CLIENTS + 1,
        table: Table::HalfFull,
    });
    cases
}

/// Fills the flow tables to `entries` with entries no frame of the run
/// meets: copies of `entry` under keys of their own (clients from
/// [`FILL_CLIENTS`] up, to a port no VIP serves). The kernel rounds a hash
/// map's buckets up to a power of two, which [`BENCH_FLOW_TABLE`] is, so
/// half its entries is 2^18 entries in 2^19 buckets.
/// Its keys are the same every time: the table must hold none of them.
fn fill_to(lb: &mut Lb, entries: usize, entry: FlowEntry) {
    let first = u32::from(FILL_CLIENTS);
    for i in 0..entries.saturating_sub(lb.flow_count()) {
        let client = Ipv4Addr::from(first + i as u32);
        lb.set_flow(
            &key(IPPROTO_TCP, (client, CLIENT_PORT), (VIP, FILL_VIP_PORT)),
            entry,
        );
    }
    assert_eq!(lb.flow_count(), entries, "the flow table filled");
}

/// Fills the table whole, then empties it back to `base`. A preallocated
/// hash map hands out its free elements last freed first, and a freshly
/// created one in the order it laid them out, so one new flow's element
/// sits next to the last one's, in the same page. A balancer that has run
/// a while has freed elements in whatever order its connections ended,
/// scattered over the table, so its inserts meet other pages; the removal
/// here frees them in bucket order, which is as scattered. Run before
/// every row, so every row draws from the same state.
fn churn(lb: &mut Lb, entry: FlowEntry, base: &[FlowKey]) {
    // The last row's entries out first: `fill_to` counts from the base.
    lb.remove_flows_except(base);
    fill_to(lb, BENCH_FLOW_TABLE as usize, entry);
    lb.remove_flows_except(base);
    assert_eq!(lb.flow_count(), base.len(), "the table back to its base");
}

/// `runs` SYNs to the VIP on `port`, each from its own client address of
/// block `case`, with a Linux SYN's options: sequence number and timestamp
/// `(seq, tsval)`.
fn new_flow_frames(port: u16, case: usize, runs: usize, syn: (u32, u32)) -> Vec<Vec<u8>> {
    (0..runs)
        .map(|i| syn_frame(client_of(case, i), port, syn))
        .collect()
}

/// A SYN from `client` to the VIP's `port` with sequence number `seq` and
/// a Linux SYN's options, its timestamp `tsval`.
fn syn_frame(client: Ipv4Addr, port: u16, (seq, tsval): (u32, u32)) -> Vec<u8> {
    Pkt::tcp((client, CLIENT_PORT), (VIP, port), TCP_SYN)
        .seq(seq)
        .tcp_options(&linux_syn_options(tsval))
        .build()
}

/// Client `i` of block `case`: 10.(64 + case).x.y, a distinct client per
/// SYN, per case.
fn client_of(case: usize, i: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 64 + case as u8, 0, 1)) + i as u32)
}

/// Runs `case.frames` round robin `case.runs` times through `case.program`,
/// each expected to give `case.action`, and returns the median and mean
/// kernel-reported cost. With a `pairing`, the runs go in blocks, each after
/// a block of the MAC-swap baseline as long as itself.
fn measure(lb: &mut Lb, case: &Case, pairing: Option<&Pairing>) -> Row {
    let blocks = pairing.map_or(1, |p| p.blocks.clamp(1, case.runs.max(1)));
    let mut ns: Vec<u32> = Vec::with_capacity(case.runs);
    let mut ratios = Vec::with_capacity(blocks);
    for block in 0..blocks {
        let range = block * case.runs / blocks..(block + 1) * case.runs / blocks;
        let baseline = pairing.map(|p| {
            let mut base: Vec<u32> = range
                .clone()
                .map(|i| run_one(lb, MACSWAP_PROGRAM, "paired MAC swap", p.frame, i, XDP_TX))
                .collect();
            median_of(&mut base)
        });
        let start = ns.len();
        for i in range {
            let frame = &case.frames[i % case.frames.len()];
            ns.push(run_one(lb, case.program, case.name, frame, i, case.action));
        }
        if let Some(base) = baseline {
            let mut own = ns[start..].to_vec();
            ratios.push(f64::from(median_of(&mut own)) / f64::from(base.max(1)));
        }
    }
    let mean_ns = ns.iter().map(|&n| f64::from(n)).sum::<f64>() / ns.len() as f64;
    Row {
        name: case.name.to_string(),
        median_ns: median_of(&mut ns),
        mean_ns,
        paired: PairedRatio::of(ratios),
    }
}

/// One `BPF_PROG_TEST_RUN` of `frame` (run `i` of its case), checked to give
/// `action`; its kernel-reported ns. The ring buffer is drained every
/// [`DRAIN_EVERY`] runs.
fn run_one(lb: &mut Lb, program: &str, name: &str, frame: &[u8], i: usize, action: u32) -> u32 {
    let (got, _, duration) = lb.run_program(program, frame, 1);
    assert_eq!(got, action, "{name}: run {i}: {:?}", lb.reasons());
    if i.is_multiple_of(DRAIN_EVERY) {
        lb.events();
    }
    duration
}

/// The median (the upper one of an even count) of `ns`, which it sorts.
fn median_of(ns: &mut [u32]) -> u32 {
    ns.sort_unstable();
    ns.get(ns.len() / 2).copied().unwrap_or(0)
}

fn print_table(rows: &[Row]) {
    let (pass, macswap) = (
        f64::from(rows[0].median_ns.max(1)),
        f64::from(rows[1].median_ns.max(1)),
    );
    println!(
        "\n{:<34} {:>10} {:>10} {:>12} {:>14} {:>22}",
        "case", "median ns", "mean ns", "x XDP_PASS", "x MAC-swap TX", "paired x (blocks)"
    );
    for r in rows {
        let m = f64::from(r.median_ns);
        let paired = r.paired.as_ref().map_or(String::from("-"), |p| {
            format!("{:.2} ({:.2}-{:.2})", p.median, p.min, p.max)
        });
        println!(
            "{:<34} {:>10} {:>10.1} {:>12.2} {:>14.2} {:>22}",
            r.name,
            r.median_ns,
            r.mean_ns,
            m / pass,
            m / macswap,
            paired
        );
    }
    println!(
        "\nkernel-reported ns per BPF_PROG_TEST_RUN with repeat=1, one CPU, fresh netns; \
         ratios use the medians; paired: the median of the case's blocks' ratios to the \
         MAC-swap block run right before each (lowest-highest block); every new-flow row \
         starts from a table sized for {BENCH_FLOW_TABLE} entries that holds one established \
         connection (2 entries; the time-wait row adds its own closed connections, the \"{}\" \
         rows fill it to {} entries), churned right before the row (filled whole and emptied, \
         so its free elements lie scattered, as in a balancer that has run a while), except \
         the \"{}\" row, measured first on the table as loaded",
        HALF_FULL.trim_start_matches(", "),
        BENCH_FLOW_TABLE / 2,
        FRESH.trim_start_matches(", "),
    );
    // What the table alone costs, against what a new flow costs in all.
    let median = |name: &str| rows.iter().find(|r| r.name == name).map(|r| r.median_ns);
    if let (Some(hash), Some(way)) = (
        median(ESTABLISHED_FLOORS[0].0),
        median(ESTABLISHED_FLOORS[1].0),
    ) {
        println!(
            "an established packet's flow lookup: {} ns as a hash-map hit, {} ns as an array \
             way (above the MAC-swap baseline)",
            hash.saturating_sub(rows[1].median_ns),
            way.saturating_sub(rows[1].median_ns),
        );
    }
    if let Some(calls) = median(CALIBRATION_CASE) {
        println!(
            "one BPF function call and its return: about {:.0} ns on this machine \
             ((calibration - MAC swap) / {CALIBRATION_CALLS})",
            f64::from(calls.saturating_sub(rows[1].median_ns)) / f64::from(CALIBRATION_CALLS),
        );
    }
    if let (Some(floor), Some(full)) = (median(FLOORS[1].0), median(&new_flow_case(P2C_SIZES[2]))) {
        let over = |ns: u32| f64::from(ns.saturating_sub(rows[1].median_ns));
        println!(
            "new flow over {} backends: {:.2}x the two-entry floor; above the MAC-swap \
             baseline, the floor's table work is {:.0} % of it",
            P2C_SIZES[2],
            f64::from(full) / f64::from(floor.max(1)),
            100.0 * over(floor) / over(full).max(1.0),
        );
        if let Some(one) = median(FLOORS[2].0) {
            println!(
                "one hash entry per connection (the reply as a way) would take the floor \
                 from {:.2}x to {:.2}x the MAC-swap baseline",
                f64::from(floor) / f64::from(rows[1].median_ns.max(1)),
                f64::from(one) / f64::from(rows[1].median_ns.max(1)),
            );
        }
        let loaded_full = median(&format!("{}{HALF_FULL}", new_flow_case(P2C_SIZES[2])));
        let loaded_floor = median(&format!("{}{HALF_FULL}", FLOORS[1].0));
        if let (Some(loaded_full), Some(loaded_floor)) = (loaded_full, loaded_floor) {
            let x = |ns: u32| f64::from(ns) / f64::from(rows[1].median_ns.max(1));
            println!(
                "on a table half full (2^18 entries in 2^19 buckets): the new flow over {} backends \
                 {:.2}x (from {:.2}x), the two-entry floor {:.2}x (from {:.2}x)",
                P2C_SIZES[2],
                x(loaded_full),
                x(full),
                x(loaded_floor),
                x(floor),
            );
        }
        if let Some(ways) = median(FLOORS[3].0) {
            // The new flow less the table work it does now, plus the
            // all-array floor's: an estimate, not a measurement.
            println!(
                "no hash entry at all (both directions as ways) would take the floor to \
                 {:.2}x, and the new flow over {} backends to about {:.2}x, if nothing else changed",
                f64::from(ways) / f64::from(rows[1].median_ns.max(1)),
                P2C_SIZES[2],
                f64::from(full.saturating_sub(floor) + ways) / f64::from(rows[1].median_ns.max(1)),
            );
        }
    }
}
