//! Files that are their owner's only, replaced whole: the run
//! directory's (locks aside) and the state directory's. Here, at the
//! bottom of the folders, because the runtime state (`settings::state`)
//! saves itself with them.
use std::{
    fs::OpenOptions,
    io::Write as _,
    os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _},
    path::Path,
};

/// Mode of such files: root's alone.
pub const PRIVATE_FILE_MODE: u32 = 0o600;

/// What [`write_private`] adds to a file's name while it replaces the
/// file: left behind by a kill mid-write.
pub const TMP_SUFFIX: &str = ".tmp";

/// Replaces `path` with `contents` atomically (a temporary file beside it,
/// renamed over it), readable and writable by its owner only
/// ([`PRIVATE_FILE_MODE`]): the run directory's files name backends, zones
/// and ports, which are nobody else's business.
pub fn write_private(path: &Path, contents: &[u8]) -> std::io::Result<()> {
    replace_private(path, contents, false)
}

/// [`write_private`] for a file that must survive a power loss (the
/// runtime state, the discovery cache, the SNAT hand-off): the temporary
/// file is synced before the rename, and the directory after it, so the
/// file is the old one or the new one, never empty. The directory is
/// created if need be.
pub fn write_durable(path: &Path, contents: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    replace_private(path, contents, true)
}

fn replace_private(path: &Path, contents: &[u8], durable: bool) -> std::io::Result<()> {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(TMP_SUFFIX);
    let tmp = path.with_file_name(name);
    let mut file = OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .mode(PRIVATE_FILE_MODE)
        .open(&tmp)?;
    // A temporary file left over keeps its mode through `open`.
    file.set_permissions(std::fs::Permissions::from_mode(PRIVATE_FILE_MODE))?;
    file.write_all(contents)?;
    if durable {
        file.sync_all()?;
    }
    drop(file);
    std::fs::rename(&tmp, path)?;
    if durable {
        let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
        std::fs::File::open(dir.unwrap_or(Path::new(".")))?.sync_all()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The state, cache and hand-off files are their owner's only, in a
    /// directory made for them, and a file an older build left readable by
    /// all is restricted when it is replaced.
    #[test]
    fn durable_files_are_private_and_replaced_whole() {
        use std::os::unix::fs::PermissionsExt as _;
        let root = std::env::temp_dir().join(format!("lb-durable-{}", std::process::id()));
        let path = root.join("state").join("x.json");
        write_durable(&path, b"one").unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&path), PRIVATE_FILE_MODE);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        write_durable(&path, b"two").unwrap();
        let (text, left) = (std::fs::read(&path).unwrap(), mode(&path));
        let leftovers = std::fs::read_dir(path.parent().unwrap()).unwrap().count();
        let _ = std::fs::remove_dir_all(&root);
        assert_eq!(text, b"two");
        assert_eq!(left, PRIVATE_FILE_MODE);
        assert_eq!(leftovers, 1, "no temporary file is left");
    }
}
