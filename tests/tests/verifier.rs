//! Verifier budget: the XDP program loads from both build profiles, and the
//! test prints how many instructions the verifier processed (against the
//! kernel's limit of one million) and the program's size.
//!
//! The release object is the one embedded in lb-user. The debug object is
//! built by `cargo xtask test` and passed in `LB_EBPF_DEBUG_OBJECT`.
use lb_lab::xdp::{
    harness::{FLOW_TABLE_SIZE, Lb},
    isolate::run_isolated,
};

/// Where `cargo xtask test` puts the debug build of the eBPF object.
const DEBUG_OBJECT_ENV: &str = "LB_EBPF_DEBUG_OBJECT";
/// The kernel's limit on instructions processed per program load.
const VERIFIER_LIMIT: u32 = 1_000_000;
/// BPF instructions are 8 bytes.
const INSN_BYTES: u32 = 8;

fn report(profile: &str, object: Vec<u8>) {
    let (verified, size, jited) = run_isolated(move || {
        let lb = Lb::load(&object, FLOW_TABLE_SIZE);
        lb.verifier_counts()
    });
    let verified = verified.expect("kernel reports the verified instruction count");
    println!(
        "lb_xdp ({profile}): {verified} instructions verified ({:.0}% of the {VERIFIER_LIMIT} limit), \
         {} instructions ({size} bytes) after verification, {jited} bytes JIT-compiled",
        f64::from(verified) * 100.0 / f64::from(VERIFIER_LIMIT),
        size / INSN_BYTES,
    );
    assert!(verified < VERIFIER_LIMIT);
}

#[test]
fn loads_in_release_and_debug() {
    lb_lab::require_root!();
    report("release", lb_lab::production::EBPF_OBJECT.to_vec());
    match std::env::var_os(DEBUG_OBJECT_ENV) {
        Some(path) => {
            let object = std::fs::read(&path)
                .unwrap_or_else(|e| panic!("reading {}: {e}", path.to_string_lossy()));
            report("debug", object);
        }
        None if std::env::var_os(lb_lab::root::REQUIRE_ROOT_ENV).is_some() => {
            panic!("{DEBUG_OBJECT_ENV} is not set: run the tests with cargo xtask test")
        }
        // Not eprintln!: libtest would show it only if the test failed.
        None => lb_lab::root::write_uncaptured(&format!(
            "\n*** SKIPPED the debug object: {DEBUG_OBJECT_ENV} is not set (cargo xtask test sets it) ***\n"
        )),
    }
}
