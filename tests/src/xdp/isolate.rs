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
