//! Batch map operations through a raw `bpf(2)` call (aya 0.14 has no
//! batch API): `BPF_MAP_UPDATE_BATCH` for the control plane's writes and
//! `BPF_MAP_LOOKUP_BATCH` for the per-tick latency read and the
//! reconciler's per-backend counters.
use std::os::fd::RawFd;

use lb_common::LatencyAgg;

/// `BPF_MAP_UPDATE_BATCH` of `enum bpf_cmd` (Linux 5.6+).
const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;
/// `BPF_MAP_LOOKUP_BATCH` of `enum bpf_cmd` (Linux 5.6+).
const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;

/// The `batch` member of `union bpf_attr`.
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// `bpf(2)` command `cmd` with the attribute `attr` (a prefix of `union
/// bpf_attr` for that command): its non-negative result, or the error.
///
/// # Safety
/// Every pointer in `attr` must point at memory that outlives the call,
/// as large as the command reads or writes there.
pub unsafe fn sys_bpf<A>(cmd: libc::c_long, attr: &mut A) -> std::io::Result<i64> {
    // SAFETY: `attr` is a live, writable attribute of its own size; what
    // it points at is the caller's promise.
    let ret = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr as *mut A, size_of::<A>()) };
    if ret < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(ret)
}

/// Writes `values[i]` at `keys[i]` of the array map `fd`, all in one call.
pub fn update<V>(fd: RawFd, keys: &[u32], values: &[V]) -> std::io::Result<()> {
    debug_assert_eq!(keys.len(), values.len());
    let mut attr = BatchAttr {
        keys: keys.as_ptr() as u64,
        values: values.as_ptr() as u64,
        count: keys.len() as u32,
        map_fd: fd as u32,
        ..BatchAttr::default()
    };
    // SAFETY: attr points at keys and values that outlive the call, each
    // `count` elements long, of the map's key and value sizes.
    unsafe { sys_bpf(BPF_MAP_UPDATE_BATCH, &mut attr) }?;
    if attr.count as usize != keys.len() {
        return Err(std::io::Error::other(format!(
            "batch update wrote {} of {} entries",
            attr.count,
            keys.len()
        )));
    }
    Ok(())
}

/// The values of keys `0..count` of the per-CPU array `fd`, key-major
/// (`cpus` values per key: a per-CPU value is padded to 8 bytes, which
/// `LatencyAgg` already is), read in one call from the first key.
pub fn lookup_per_cpu(fd: RawFd, count: usize, cpus: usize) -> std::io::Result<Vec<LatencyAgg>> {
    const { assert!(size_of::<LatencyAgg>().is_multiple_of(8)) };
    lookup_first(fd, count, cpus)
}

/// The values of keys `0..count` of the (plain) array `fd`, read in one
/// call. `V` must be the map's value type exactly.
pub fn lookup_array<V: aya::Pod + Default>(fd: RawFd, count: usize) -> std::io::Result<Vec<V>> {
    lookup_first(fd, count, 1)
}

/// Keys `0..count` of an array map, `per_key` values of `V` each.
fn lookup_first<V: Copy + Default>(
    fd: RawFd,
    count: usize,
    per_key: usize,
) -> std::io::Result<Vec<V>> {
    if count == 0 {
        return Ok(Vec::new());
    }
    let mut keys = vec![0u32; count];
    let mut values = vec![V::default(); count * per_key];
    let mut next = 0u32;
    let mut attr = BatchAttr {
        out_batch: &mut next as *mut u32 as u64,
        keys: keys.as_mut_ptr() as u64,
        values: values.as_mut_ptr() as u64,
        count: count as u32,
        map_fd: fd as u32,
        ..BatchAttr::default()
    };
    // SAFETY: attr points at buffers that outlive the call: `count`
    // keys of 4 bytes, `count × per_key` values of the map's value size
    // (per-CPU ones padded to 8, which callers check), and one 4-byte key
    // for the position after.
    match unsafe { sys_bpf(BPF_MAP_LOOKUP_BATCH, &mut attr) } {
        // ENOENT: the walk reached the map's end (`count` is every key).
        Err(e) if e.raw_os_error() != Some(libc::ENOENT) => return Err(e),
        _ => {}
    }
    if attr.count as usize != count || keys.iter().enumerate().any(|(i, &k)| k as usize != i) {
        return Err(std::io::Error::other(format!(
            "batch lookup read {} of {count} entries",
            attr.count
        )));
    }
    Ok(values)
}

/// The kernel's internal "not supported" (not in libc).
const ENOTSUPP: i32 = 524;

/// Whether `e` says the kernel has no batch operations for the map.
pub fn unsupported(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EINVAL | libc::EOPNOTSUPP | ENOTSUPP)
    )
}
