//! Where the lab finds the programs it runs inside namespaces.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// Paths of the three programs the lab runs.
#[derive(Debug, Clone)]
pub struct Binaries {
    /// The balancer under test (`lb-user`), or why it was not found: labs that
    /// never start the balancer work without it, the others fail with the
    /// reason when they first need it.
    pub lb_user: Result<PathBuf, String>,
    /// The backend server of this crate (`lb-backend`).
    pub lb_backend: PathBuf,
    /// The open-loop load generator of this crate (`lb-loadgen`).
    pub lb_loadgen: PathBuf,
}

impl Binaries {
    /// Finds every binary: first an environment variable (`LB_USER_BIN`,
    /// `LB_BACKEND_BIN`, `LB_LOADGEN_BIN`), then the cargo target directory
    /// the running executable belongs to (`target/<profile>/`, also when the
    /// executable is a test in `target/<profile>/deps/`).
    pub fn locate() -> Result<Self> {
        Ok(Self {
            lb_user: find_lb_user(),
            lb_backend: find("lb-backend", "LB_BACKEND_BIN", "cargo build -p lb-tests")?,
            lb_loadgen: find("lb-loadgen", "LB_LOADGEN_BIN", "cargo build -p lb-tests")?,
        })
    }

    /// For the lab's tests: [`Binaries::locate`], or a panic that says what
    /// is missing (cargo builds this crate's binaries before its tests).
    pub fn for_tests() -> Self {
        Self::locate().unwrap_or_else(|e| panic!("{e:#}"))
    }

    /// The `lb-user` binary, or an error saying how to build it.
    pub fn lb_user(&self) -> Result<&Path> {
        self.lb_user
            .as_deref()
            .map_err(|reason| anyhow::anyhow!("{reason}"))
    }
}

fn find_lb_user() -> Result<PathBuf, String> {
    find("lb-user", "LB_USER_BIN", "cargo build -p lb-user").map_err(|error| format!("{error:#}"))
}

/// Finds one binary by environment variable or next to the running executable.
pub fn find(name: &str, env_var: &str, build_hint: &str) -> Result<PathBuf> {
    if let Some(path) = std::env::var_os(env_var) {
        let path = PathBuf::from(path);
        if !path.is_file() {
            bail!("{env_var}={} does not name a file", path.display());
        }
        return Ok(path);
    }
    let exe = std::env::current_exe().context("cannot locate the running executable")?;
    let candidates = profile_dirs(&exe)
        .into_iter()
        .map(|dir| dir.join(name))
        .collect::<Vec<_>>();
    if let Some(found) = candidates.iter().find(|path| path.is_file()) {
        return Ok(found.clone());
    }
    let looked = candidates
        .iter()
        .map(|path| path.display().to_string())
        .collect::<Vec<_>>()
        .join(", ");
    bail!(
        "{name} binary not found (looked in: {looked}); run `{build_hint}` with the same CARGO_TARGET_DIR and profile, or set {env_var}"
    )
}

/// `target/<profile>/` for an executable in it or in its `deps/` folder.
fn profile_dirs(exe: &Path) -> Vec<PathBuf> {
    let Some(dir) = exe.parent() else {
        return Vec::new();
    };
    let mut dirs = vec![dir.to_path_buf()];
    if dir.file_name().is_some_and(|name| name == "deps")
        && let Some(profile) = dir.parent()
    {
        dirs.insert(0, profile.to_path_buf());
    }
    dirs
}
