//! The balancers we compare against, configured the way their users would
//! for this job, running in the lab's balancer namespace on the VIP.

use std::{fmt::Write as _, net::SocketAddr, path::Path, process::Command, time::Duration};

use anyhow::{Context, Result, bail};

use super::scenario::Row;
use crate::lab::{Lab, ProcessId};

/// Where Debian's nginx keeps its dynamic stream module.
const NGINX_STREAM_MODULE: &str = "/usr/lib/nginx/modules/ngx_stream_module.so";
/// How long a peer may take to listen on the VIP.
const LISTEN_TIMEOUT: Duration = Duration::from_secs(10);
/// nftables table the bench creates (and removes) in the balancer namespace.
const NFT_TABLE: &str = "lbbench";

/// What running `rows` needs from Debian's packages, as (a file that
/// shows it is there, the packages that bring it): haproxy for HAProxy
/// rows, nginx's stream module for nginx rows, nftables for the nftables
/// row, and always the plots' font (every run draws its CDFs). A run of
/// our rows alone needs no peer, so it must not run apt-get for one (the
/// lab tests run such a row, where the peers need not be installed).
fn requirements(rows: &[Row]) -> Vec<(&'static str, &'static [&'static str])> {
    let mut needs: Vec<(&'static str, &'static [&'static str])> = Vec::new();
    if rows.iter().any(|r| matches!(r, Row::Haproxy(_))) {
        needs.push(("/usr/sbin/haproxy", &["haproxy"]));
    }
    if rows.iter().any(|r| matches!(r, Row::Nginx(_))) {
        needs.push((NGINX_STREAM_MODULE, &["nginx", "libnginx-mod-stream"]));
    }
    if rows.contains(&Row::Nftables) {
        needs.push(("/usr/sbin/nft", &["nftables"]));
    }
    needs.push((super::plot::FONT, &["fonts-dejavu-core"]));
    needs
}

/// Installs what running `rows` needs ([`requirements`]) from Debian's
/// packages when it is missing; nothing is installed, and apt-get is not
/// run, when all of it is there.
pub fn ensure_installed(rows: &[Row]) -> Result<()> {
    let missing: Vec<&str> = requirements(rows)
        .into_iter()
        .filter(|(file, _)| !Path::new(file).exists())
        .flat_map(|(_, packages)| packages.iter().copied())
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!("bench: installing {}", missing.join(" "));
    let update = Command::new("apt-get").arg("update").status()?;
    if !update.success() {
        bail!("apt-get update failed");
    }
    let status = Command::new("apt-get")
        .args(["install", "-y", "--no-install-recommends"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .status()
        .context("running apt-get install")?;
    if !status.success() {
        bail!("apt-get install {} failed", missing.join(" "));
    }
    Ok(())
}

/// HAProxy in TCP mode with `balance <algorithm>`.
pub fn start_haproxy(
    lab: &Lab,
    algorithm: &str,
    vip: SocketAddr,
    backends: &[SocketAddr],
) -> Result<ProcessId> {
    let mut cfg = String::from(
        "global\n  maxconn 8000\n  log stderr format raw local0 emerg\n\
         defaults\n  mode tcp\n  timeout connect 2s\n  timeout client 30s\n  timeout server 30s\n",
    );
    let _ = writeln!(cfg, "frontend vip\n  bind {vip}\n  default_backend pool");
    let _ = writeln!(cfg, "backend pool\n  balance {algorithm}");
    for (i, b) in backends.iter().enumerate() {
        let _ = writeln!(cfg, "  server be{} {b}", i + 1);
    }
    let path = lab.log_dir().join("haproxy.cfg");
    std::fs::write(&path, cfg)?;
    let process = lab.spawn(
        &lab.balancer().ns,
        "haproxy",
        &["haproxy", "-db", "-f", &path.display().to_string()],
    )?;
    wait_listening(lab, process, vip)?;
    Ok(process)
}

/// nginx's stream proxy; `method` is the upstream directive (empty for
/// round robin, `least_conn;`, `random two least_conn;`).
pub fn start_nginx(
    lab: &Lab,
    method: &str,
    vip: SocketAddr,
    backends: &[SocketAddr],
) -> Result<ProcessId> {
    let dir = lab.log_dir().join("nginx");
    std::fs::create_dir_all(&dir)?;
    let d = dir.display();
    let mut cfg = format!(
        "load_module {NGINX_STREAM_MODULE};\ndaemon off;\nworker_processes auto;\n\
         pid {d}/nginx.pid;\nerror_log {d}/error.log warn;\n\
         events {{ worker_connections 16384; }}\n\
         stream {{\n  upstream pool {{\n    {method}\n"
    );
    for b in backends {
        let _ = writeln!(cfg, "    server {b};");
    }
    let _ = write!(
        cfg,
        "  }}\n  server {{\n    listen {vip} backlog=4096;\n    proxy_pass pool;\n    \
         proxy_connect_timeout 2s;\n  }}\n}}\n"
    );
    let path = dir.join("nginx.conf");
    std::fs::write(&path, cfg)?;
    let process = lab.spawn(
        &lab.balancer().ns,
        "nginx",
        &[
            "nginx",
            "-p",
            &d.to_string(),
            "-e",
            &format!("{d}/error.log"),
            "-c",
            &path.display().to_string(),
        ],
    )?;
    wait_listening(lab, process, vip)?;
    Ok(process)
}

/// kube-proxy's nftables style: DNAT to `numgen random mod N` over the
/// backends, masquerade so replies return through the balancer.
pub fn start_nftables(lab: &Lab, vip: SocketAddr, backends: &[SocketAddr]) -> Result<()> {
    let ns = &lab.balancer().ns;
    let iface = &lab.balancer().iface;
    for (key, value) in [
        ("net.ipv4.ip_forward", "1"),
        // One-arm: forwarded packets leave by the interface they came in on;
        // ICMP redirects would tell the client to bypass the balancer.
        ("net.ipv4.conf.all.send_redirects", "0"),
        (&format!("net.ipv4.conf.{iface}.send_redirects"), "0"),
    ] {
        lab.exec_ok(ns, &["sysctl", "-qw", &format!("{key}={value}")])?;
    }
    let elements: Vec<String> = backends
        .iter()
        .enumerate()
        .map(|(i, b)| format!("{i} : {} . {}", b.ip(), b.port()))
        .collect();
    let rules = format!(
        "table ip {NFT_TABLE} {{\n\
         \x20 chain pre {{\n\
         \x20   type nat hook prerouting priority dstnat;\n\
         \x20   ip daddr {} tcp dport {} dnat ip addr . port to numgen random mod {} map {{ {} }}\n\
         \x20 }}\n\
         \x20 chain post {{\n\
         \x20   type nat hook postrouting priority srcnat;\n\
         \x20   ct status dnat masquerade\n\
         \x20 }}\n\
         }}\n",
        vip.ip(),
        vip.port(),
        backends.len(),
        elements.join(", ")
    );
    let path = lab.log_dir().join("nft.rules");
    std::fs::write(&path, rules)?;
    lab.exec_ok(ns, &["nft", "-f", &path.display().to_string()])?;
    Ok(())
}

/// Removes the nftables rules and turns forwarding off again.
pub fn stop_nftables(lab: &Lab) -> Result<()> {
    let ns = &lab.balancer().ns;
    lab.exec_ok(ns, &["nft", "delete", "table", "ip", NFT_TABLE])?;
    lab.exec_ok(ns, &["sysctl", "-qw", "net.ipv4.ip_forward=0"])?;
    Ok(())
}

/// Waits until something in the balancer namespace listens on `vip`.
fn wait_listening(lab: &Lab, process: ProcessId, vip: SocketAddr) -> Result<()> {
    let deadline = std::time::Instant::now() + LISTEN_TIMEOUT;
    let wanted = vip.to_string();
    loop {
        if let Some(status) = lab.exit_status(process)? {
            bail!(
                "exited during start-up ({status}): {}",
                lab.stderr(process).trim()
            );
        }
        let listening = lab.exec_ok(&lab.balancer().ns, &["ss", "-Hltn"])?;
        if listening.split_whitespace().any(|w| w == wanted) {
            return Ok(());
        }
        if std::time::Instant::now() >= deadline {
            bail!("not listening on {vip} after {LISTEN_TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lab::Algorithm;

    fn packages(rows: &[Row]) -> Vec<&'static str> {
        requirements(rows)
            .into_iter()
            .flat_map(|(_, packages)| packages.iter().copied())
            .collect()
    }

    #[test]
    fn only_rows_of_a_peer_need_that_peer() {
        let ours = [
            Row::Ours(Algorithm::P2cEwma),
            Row::OursZoneAware(Algorithm::P2cEwma),
            Row::Oracle,
        ];
        assert_eq!(packages(&ours), ["fonts-dejavu-core"]);
        assert_eq!(
            packages(&[Row::Ours(Algorithm::LeastConn), Row::Haproxy("leastconn")]),
            ["haproxy", "fonts-dejavu-core"]
        );
        assert_eq!(
            packages(&Row::all()),
            [
                "haproxy",
                "nginx",
                "libnginx-mod-stream",
                "nftables",
                "fonts-dejavu-core"
            ]
        );
    }
}
