//! Runs packet tests on one thread pinned to one CPU inside a fresh network
//! namespace: per-CPU counters are then read back from the CPU that ran the
//! program, and `bpf_fib_lookup` finds no routes, so next hops come from the
//! `NEIGHBOURS` map deterministically.

/// The CPU packet tests run on.
pub const TEST_CPU: usize = 0;

/// Pins the calling thread to [`TEST_CPU`] and moves it into a new network
/// namespace. Call it on a dedicated thread: both die with the thread.
pub fn isolate_thread() {
    // SAFETY: plain syscalls on this thread with a zero-initialised cpu_set_t.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(TEST_CPU, &mut set);
        assert_eq!(
            libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set),
            0,
            "sched_setaffinity: {}",
            std::io::Error::last_os_error()
        );
        assert_eq!(
            libc::unshare(libc::CLONE_NEWNET),
            0,
            "unshare(CLONE_NEWNET): {}",
            std::io::Error::last_os_error()
        );
    }
}

/// Runs `body` on a new thread isolated by [`isolate_thread`] and returns
/// its result; a panic inside fails the caller.
pub fn run_isolated<T: Send + 'static>(body: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(move || {
        isolate_thread();
        body()
    })
    .join()
    .unwrap_or_else(|e| std::panic::resume_unwind(e))
}

/// Where [`private_bpffs`] mounts its BPF filesystem.
const BPFFS: &str = "/sys/fs/bpf";

std::thread_local! {
    static PRIVATE_BPFFS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// A BPF filesystem of the calling thread's own, for pinning maps: on the
/// first call the thread gets a private mount namespace with a fresh bpffs
/// on /sys/fs/bpf, which nobody else sees and which goes away with the
/// thread. Call it on an isolated thread ([`run_isolated`]).
pub fn private_bpffs() -> std::path::PathBuf {
    use nix::mount::{MsFlags, mount};
    if !PRIVATE_BPFFS.get() {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS).expect("unshare(CLONE_NEWNS)");
        // Keep our mounts from propagating back to the host's namespace.
        mount(
            None::<&str>,
            "/",
            None::<&str>,
            MsFlags::MS_REC | MsFlags::MS_PRIVATE,
            None::<&str>,
        )
        .expect("making / private");
        mount(
            Some("bpf"),
            BPFFS,
            Some("bpf"),
            MsFlags::empty(),
            None::<&str>,
        )
        .expect("mounting a bpffs");
        PRIVATE_BPFFS.set(true);
    }
    BPFFS.into()
}
