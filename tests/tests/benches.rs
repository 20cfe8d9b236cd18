//! The benchmarks still run: each `cargo xtask bench` binary, at a size
//! that takes seconds, end to end (programs loaded, labs built, real
//! clients and servers), and its report holds every row with sane values.
//! Their speed goals are the benches' own business (their full runs print
//! ratios against a baseline of the same run); here nothing is timed
//! beyond orderings no noise can turn over, and no result is written
//! (the benches write `docs/bench` only at the full size).
//!
//! Run as root: `cargo test -p lb-tests --test benches -- --test-threads=1`.

use std::{
    io::Read,
    path::Path,
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use lb_lab::require_root;

/// How long one bench run may take: the runs here are sized to take
/// seconds to minutes, so this only catches a hang (which `.output()`
/// would wait on forever, holding its labs and the machine).
const BENCH_DEADLINE: Duration = Duration::from_secs(15 * 60);
/// How long a bench past its deadline gets after SIGTERM (it then removes
/// its labs) before SIGKILL.
const BENCH_STOP_GRACE: Duration = Duration::from_secs(10);
const POLL: Duration = Duration::from_millis(200);

/// Reads a pipe to its end on a helper thread, so a chatty bench never
/// blocks on a full pipe while it is waited for.
fn drain(pipe: Option<impl Read + Send + 'static>) -> thread::JoinHandle<String> {
    thread::spawn(move || {
        let mut bytes = Vec::new();
        if let Some(mut pipe) = pipe {
            let _ = pipe.read_to_end(&mut bytes);
        }
        String::from_utf8_lossy(&bytes).into_owned()
    })
}

/// What `drain` read, once the pipe is closed; waits at most
/// [`BENCH_STOP_GRACE`] for that, since a process the bench left behind
/// (after a SIGKILL) may hold the pipe open.
fn drained(reader: thread::JoinHandle<String>) -> String {
    let waited = Instant::now();
    while !reader.is_finished() && waited.elapsed() < BENCH_STOP_GRACE {
        thread::sleep(POLL);
    }
    if reader.is_finished() {
        reader.join().unwrap_or_default()
    } else {
        "(not read: the pipe is still open)".into()
    }
}

/// Waits for `child` until `deadline`; None if it still runs then.
fn wait_until(child: &mut Child, deadline: Instant) -> Option<std::process::ExitStatus> {
    loop {
        if let Some(status) = child.try_wait().expect("waiting for a bench") {
            return Some(status);
        }
        if Instant::now() >= deadline {
            return None;
        }
        thread::sleep(POLL);
    }
}

/// Runs a bench binary of this package with `args`; its standard output
/// (the run must succeed within [`BENCH_DEADLINE`]; past it, the bench is
/// stopped with SIGTERM, SIGKILL [`BENCH_STOP_GRACE`] later, and the test
/// fails naming it).
fn run_bench(exe: &str, args: &[&str]) -> String {
    let name = Path::new(exe)
        .file_name()
        .map_or(exe.into(), |n| n.to_string_lossy());
    let mut child = Command::new(exe)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("running {exe}: {e}"));
    let stdout = drain(child.stdout.take());
    let stderr = drain(child.stderr.take());
    let Some(status) = wait_until(&mut child, Instant::now() + BENCH_DEADLINE) else {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        if wait_until(&mut child, Instant::now() + BENCH_STOP_GRACE).is_none() {
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!(
            "{name} {args:?} still ran after {BENCH_DEADLINE:?}: stopped\n{}",
            drained(stderr)
        );
    };
    let stdout = drained(stdout);
    assert!(
        status.success(),
        "{name} {args:?} failed ({status}):\n{stdout}\n{}",
        drained(stderr)
    );
    stdout
}

/// The cells of the markdown table row whose first cell is `first`.
fn row<'a>(report: &'a str, first: &str) -> Vec<&'a str> {
    report
        .lines()
        .find_map(|l| {
            let cells: Vec<&str> = l
                .trim()
                .strip_prefix('|')?
                .split('|')
                .map(str::trim)
                .collect();
            (cells.first() == Some(&first)).then_some(cells)
        })
        .unwrap_or_else(|| panic!("no row '{first}' in:\n{report}"))
}

/// A number as the reports print it (`12,768`, `1,000 /s`, `0.0000`).
fn number(cell: &str) -> f64 {
    cell.split_whitespace()
        .next()
        .map(|n| n.replace(',', ""))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("not a number: '{cell}'"))
}

/// The dataplane table's paired ratio of `case` (its last column, e.g.
/// `2.35 (2.30-2.35)`).
fn paired_ratio(report: &str, case: &str) -> f64 {
    let line = report
        .lines()
        // The name whole: "new flow, P2C over 1024 backends" is also the
        // start of its fresh-table and half-full rows' names.
        .find(|l| {
            l.strip_prefix(case).is_some_and(|rest| {
                rest.starts_with(' ') && rest.trim_start().starts_with(|c: char| c.is_ascii_digit())
            })
        })
        .unwrap_or_else(|| panic!("no case '{case}' in:\n{report}"));
    let before_blocks = line.rsplit_once(" (").map_or(line, |(head, _)| head);
    let ratio = before_blocks.split_whitespace().last().unwrap_or_default();
    ratio
        .parse()
        .unwrap_or_else(|_| panic!("no paired ratio in '{line}'"))
}

#[test]
fn the_dataplane_bench_measures_every_case() {
    require_root!();
    let report = run_bench(
        env!("CARGO_BIN_EXE_lb-bench-dataplane"),
        &["--runs", "500", "--blocks", "2"],
    );
    let established = [
        "established, client -> backend",
        "established, backend -> client",
    ];
    let new_flows = [
        "new flow, P2C over 2 backends",
        "new flow, P2C over 64 backends",
        "new flow, P2C over 1024 backends",
        "new flow, P2C over 16 backends",
        "new flow, least connections over 16 backends",
        "new flow, every tuple in time wait",
        "new flow, P2C over 1024 backends, fresh table",
        "new flow, P2C over 1024 backends, table half full",
    ];
    let floors = [
        "floor: established, hash-map hit",
        "floor: established, array way hit",
        "floor: new flow, 1 table entry",
        "floor: new flow, 2 table entries",
        "floor: new flow, 1 entry + reply way",
        "floor: new flow, 2 ways, no entry",
        "floor: new flow, 2 table entries, table half full",
    ];
    for case in established
        .iter()
        .chain(&new_flows)
        .chain(&floors)
        .chain(&["calibration: 4 calls + MAC swap", "miss (not VIP traffic)"])
    {
        let ratio = paired_ratio(&report, case);
        // Everything does more than swap two MACs and send the frame back.
        assert!(
            ratio.is_finite() && ratio > 1.0,
            "{case}: {ratio}x the MAC-swap baseline\n{report}"
        );
    }
    // A new flow (a miss, two inserts, a pick) costs several established
    // packets (one lookup): a margin no noise closes.
    for (e, n) in established.iter().zip(&new_flows) {
        assert!(
            paired_ratio(&report, n) > 2.0 * paired_ratio(&report, e),
            "{n} against {e}:\n{report}"
        );
    }
    for summary in [
        "an established packet's flow lookup:",
        "one BPF function call and its return:",
        "new flow over 1024 backends:",
        "on a table half full (2^18 entries in 2^19 buckets):",
    ] {
        assert!(report.contains(summary), "no '{summary}' in:\n{report}");
    }
}

#[test]
fn the_capacity_bench_sustains_a_small_rate_through_the_vip() {
    require_root!();
    let report = run_bench(
        env!("CARGO_BIN_EXE_lb-bench-capacity"),
        &[
            "--target",
            "1000",
            "--duration",
            "3s",
            "--ceiling-step",
            "2s",
            "--ceiling-start",
            "500",
            "--ceiling-max",
            "1000",
            "--ceiling-refine",
            "0",
            "--refine",
            "0",
        ],
    );
    let sustained = row(
        &report,
        "Sustained through the VIP (every connection answered, 0 refused, 0 SYN retransmits)",
    );
    assert_eq!(number(sustained[1]), 1000.0, "{report}");
    assert_eq!(row(&report, "Result")[1], "PASS", "{report}");
    let events = row(&report, "Ring-buffer events per connection (failures only)");
    assert_eq!(number(events[1]), 0.0, "{report}");
    let vip_run = row(&report, "VIP");
    // Completed, refused and SYN retransmits of the one run through the VIP.
    assert_eq!(number(vip_run[3]), 3000.0, "{report}");
    assert_eq!(number(vip_run[5]), 0.0, "{report}");
    assert_eq!(number(vip_run[6]), 0.0, "{report}");
}

#[test]
fn the_tail_bench_runs_every_case_with_apachebench() {
    require_root!();
    let report = run_bench(
        env!("CARGO_BIN_EXE_lb-bench-tail"),
        &["--requests", "600", "--rounds", "1"],
    );
    for case in [
        "quarantine past TIME_WAIT",
        "reuse inside TIME_WAIT",
        "quarantine past TIME_WAIT, client without timestamps",
        "reuse inside TIME_WAIT, client without timestamps",
        "time-wait reuse (RFC 6191), quarantine past TIME_WAIT",
    ] {
        let cells = row(&report, case);
        // Requests, failed, and the SYN retransmits column is a count.
        assert_eq!(number(cells[4]), 600.0, "{case}:\n{report}");
        assert_eq!(number(cells[5]), 0.0, "{case}:\n{report}");
        number(cells[8]);
    }
}
