//! One test per case for the data-driven suites (the fixtures, the packet
//! cases and the algorithm cases): their targets are `harness = false`, build
//! one [`libtest_mimic::Trial`] per case and hand the list to [`run`]. So
//! `cargo test -- --list` lists every case, a name filter (or `--exact`) runs
//! one alone, a failure names its case and hides none after it, and
//! `--test-threads=1` is accepted as with the standard harness.
//!
//! A packet case needs root (`BPF_PROG_TEST_RUN`). It runs on a thread of its
//! own, pinned to [`TEST_CPU`](crate::xdp::isolate::TEST_CPU) in a fresh
//! network namespace ([`run_isolated`]), so per-CPU counters are read back
//! from the CPU that ran the program. Without root the root policy of
//! [`require_root!`](crate::require_root) holds for every case: with
//! `LB_TESTS_REQUIRE_ROOT` set the case fails; otherwise it is reported as
//! ignored, under one banner that is hard to miss.
use libtest_mimic::{Arguments, Failed, Trial};

use crate::{
    root::{REQUIRE_ROOT_ENV, is_root},
    xdp::isolate::run_isolated,
};

/// Whether a privileged case can run here.
enum Privilege {
    Granted,
    /// Not root and `LB_TESTS_REQUIRE_ROOT` is set: the case fails.
    Required,
    /// Not root: the case is skipped (reported as ignored).
    Skipped,
}

fn privilege() -> Privilege {
    if is_root() {
        Privilege::Granted
    } else if std::env::var_os(REQUIRE_ROOT_ENV).is_some() {
        Privilege::Required
    } else {
        Privilege::Skipped
    }
}

/// A case that drives the XDP program through `BPF_PROG_TEST_RUN`: `body`
/// runs isolated (pinned CPU, fresh network namespace), and needs root.
pub fn packet_case(name: impl Into<String>, body: impl FnOnce() + Send + 'static) -> Trial {
    let skipped = matches!(privilege(), Privilege::Skipped);
    Trial::test(name, move || match privilege() {
        Privilege::Granted => {
            run_isolated(body);
            Ok(())
        }
        Privilege::Required => Err(Failed::from(
            "needs root, and LB_TESTS_REQUIRE_ROOT forbids skipping",
        )),
        // Only reached with --ignored / --include-ignored.
        Privilege::Skipped => {
            eprintln!("*** SKIPPED: needs root (BPF_PROG_TEST_RUN) ***");
            Ok(())
        }
    })
    .with_ignored_flag(skipped)
}

/// A case that needs no privilege (a check on the case list itself, or on
/// pure functions): runs on the harness's thread.
pub fn plain_case(name: impl Into<String>, body: impl FnOnce() + Send + 'static) -> Trial {
    Trial::test(name, move || {
        body();
        Ok(())
    })
}

/// Runs `trials` under the command line's arguments (filters, `--list`,
/// `--exact`, `--test-threads`, ...) and exits with the outcome.
pub fn run(suite: &str, trials: Vec<Trial>) -> ! {
    let (args, trials) = arguments(trials);
    if !args.list && matches!(privilege(), Privilege::Skipped) {
        eprintln!();
        eprintln!("************************************************************");
        eprintln!("*** SKIPPED {suite}: its packet cases need root (BPF_PROG_TEST_RUN) ***");
        eprintln!("*** they are listed as ignored; run as root to run them ***");
        eprintln!("************************************************************");
    }
    libtest_mimic::run(&args, trials).exit()
}

/// Options of the standard harness that take a value (`--option VALUE`).
const VALUE_OPTIONS: [&str; 6] = [
    "--test-threads",
    "--logfile",
    "--skip",
    "--color",
    "--format",
    "-Z",
];

/// The command line, and the trials it selects. libtest-mimic takes one
/// name filter, the standard harness several (`cargo test -- a b` runs the
/// tests that match either): with more than one, the trials are selected
/// here.
fn arguments(trials: Vec<Trial>) -> (Arguments, Vec<Trial>) {
    let mut argv = std::env::args();
    let mut rest: Vec<String> = argv.next().into_iter().collect();
    let mut filters = Vec::new();
    while let Some(arg) = argv.next() {
        if VALUE_OPTIONS.contains(&arg.as_str()) {
            rest.push(arg);
            rest.extend(argv.next());
        } else if arg.starts_with('-') {
            rest.push(arg);
        } else {
            filters.push(arg);
        }
    }
    if filters.len() <= 1 {
        rest.extend(filters);
        return (Arguments::from_iter(rest), trials);
    }
    let args = Arguments::from_iter(rest);
    let selected = trials
        .into_iter()
        .filter(|trial| {
            filters.iter().any(|filter| {
                if args.exact {
                    trial.name() == filter
                } else {
                    trial.name().contains(filter.as_str())
                }
            })
        })
        .collect();
    (args, selected)
}

/// `text` as a test-name segment: lower case, words joined by `_`
/// ("v4: SYN opens a flow" → "v4_syn_opens_a_flow").
pub fn slug(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_ascii_alphanumeric() {
            out.push(c.to_ascii_lowercase());
        } else if c == '\'' {
            // "flow's" → "flows"
        } else if !out.is_empty() && !out.ends_with('_') {
            out.push('_');
        }
    }
    while out.ends_with('_') {
        out.pop();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::slug;

    #[test]
    fn slugs_are_lower_case_words_joined_by_underscores() {
        assert_eq!(slug("v4: SYN opens a flow"), "v4_syn_opens_a_flow");
        assert_eq!(slug("802.3 length field (LLC)"), "802_3_length_field_llc");
        assert_eq!(slug("  -x- "), "x");
        assert_eq!(slug("a closed flow's tuple"), "a_closed_flows_tuple");
    }
}
