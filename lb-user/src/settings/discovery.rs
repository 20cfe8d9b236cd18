//! Discovery settings: where etcd is, how to reach it (TLS, user), which
//! VIPs take their backends from a key prefix, where the last known
//! backends are cached, and how many removals one update may apply.
//!
//! Flags: `--etcd-endpoints URL[,URL…]`, `--etcd-ca FILE`, `--etcd-cert FILE`,
//! `--etcd-key FILE`, `--etcd-user NAME`, `--etcd-password-file FILE` (or
//! `--etcd-password TEXT`, which every local user sees in the process list),
//! `--state-dir DIR`, `--max-removal-percent P`, and `--etcd-prefix PREFIX`
//! for the VIP given with `--vip`. The file says the same with
//! `etcd_endpoints = [...]`, `etcd_ca`, … at the top level and
//! `etcd_prefix` in a `[[vip]]`.

use std::path::PathBuf;

use clap::Args;
use serde::Deserialize;

use crate::settings::{error::ConfigError, zone::ZoneName};

/// At most this share of a VIP's backends is removed by one update.
pub const DEFAULT_MAX_REMOVAL_PERCENT: u32 = 50;

/// The discovery flags (all optional, so a file can say them instead).
#[derive(Clone, Debug, Default, Args)]
pub struct DiscoveryArgs {
    /// etcd v3 endpoints, URL[,URL…] (http://IP:PORT or https://…).
    #[arg(long, value_name = "URL[,URL…]", value_delimiter = ',')]
    pub etcd_endpoints: Vec<String>,
    /// CA certificate (PEM) that etcd's server certificate must chain to.
    #[arg(long, value_name = "FILE")]
    pub etcd_ca: Option<PathBuf>,
    /// Client certificate (PEM) for mutual TLS (with --etcd-key).
    #[arg(long, value_name = "FILE")]
    pub etcd_cert: Option<PathBuf>,
    /// Client key (PEM) for mutual TLS (with --etcd-cert).
    #[arg(long, value_name = "FILE")]
    pub etcd_key: Option<PathBuf>,
    /// etcd user name (with --etcd-password).
    #[arg(long, value_name = "NAME")]
    pub etcd_user: Option<String>,
    /// etcd password (every local user sees it in the process list: prefer
    /// --etcd-password-file).
    #[arg(long, value_name = "TEXT")]
    pub etcd_password: Option<String>,
    /// File whose first line is the etcd password (a systemd credential, a
    /// mounted secret).
    #[arg(long, value_name = "FILE", conflicts_with = "etcd_password")]
    pub etcd_password_file: Option<PathBuf>,
    /// The --vip takes its backends from the etcd keys under this prefix.
    #[arg(long, value_name = "PREFIX")]
    pub etcd_prefix: Option<String>,
    /// Largest share of a VIP's backends one discovery update may remove,
    /// in percent (default 50; never the last one).
    #[arg(long, value_name = "PERCENT")]
    pub max_removal_percent: Option<u32>,
}

/// The file's keys of the same names (see the module docs).
#[derive(Clone, Debug, Default, Deserialize)]
pub struct FileDiscovery {
    pub etcd_endpoints: Option<Vec<String>>,
    pub etcd_ca: Option<PathBuf>,
    pub etcd_cert: Option<PathBuf>,
    pub etcd_key: Option<PathBuf>,
    pub etcd_user: Option<String>,
    pub etcd_password: Option<String>,
    pub etcd_password_file: Option<PathBuf>,
    pub max_removal_percent: Option<u32>,
}

/// How to reach etcd.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EtcdSettings {
    pub endpoints: Vec<String>,
    pub ca: Option<PathBuf>,
    /// Client certificate and key, both or neither.
    pub identity: Option<(PathBuf, PathBuf)>,
    /// User and password, both or neither.
    pub user: Option<(String, String)>,
}

/// The validated discovery settings of a balancer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Discovery {
    /// `None`: no etcd configured (then no VIP may name a prefix).
    pub etcd: Option<EtcdSettings>,
    pub max_removal_percent: u32,
}

impl Default for Discovery {
    fn default() -> Self {
        Self {
            etcd: None,
            max_removal_percent: DEFAULT_MAX_REMOVAL_PERCENT,
        }
    }
}

fn bad(text: String) -> ConfigError {
    ConfigError::Ops(text)
}

/// `http://host:port` or `https://host:port` (or a bare `host:port`).
pub fn check_endpoint(url: &str) -> Result<(), ConfigError> {
    let rest = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"))
        .unwrap_or(url);
    let ok = rest
        .rsplit_once(':')
        .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0));
    if !ok || url.chars().any(char::is_whitespace) {
        return Err(bad(format!(
            "invalid etcd endpoint '{url}' (expected http://HOST:PORT or https://HOST:PORT)"
        )));
    }
    Ok(())
}

/// A key prefix: printable, no whitespace, not empty.
pub fn check_prefix(prefix: &str) -> Result<(), ConfigError> {
    if prefix.is_empty() || prefix.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(bad(format!(
            "invalid etcd prefix '{prefix}' (expected a non-empty key prefix without spaces)"
        )));
    }
    Ok(())
}

impl DiscoveryArgs {
    /// Flags over the file's keys, validated.
    pub fn resolve(&self, file: &FileDiscovery) -> Result<Discovery, ConfigError> {
        let endpoints = if self.etcd_endpoints.is_empty() {
            file.etcd_endpoints.clone().unwrap_or_default()
        } else {
            self.etcd_endpoints.clone()
        };
        let endpoints: Vec<String> = endpoints
            .iter()
            .map(|e| e.trim().to_string())
            .filter(|e| !e.is_empty())
            .collect();
        for e in &endpoints {
            check_endpoint(e)?;
        }
        let pick = |flag: &Option<PathBuf>, key: &Option<PathBuf>| flag.clone().or(key.clone());
        let ca = pick(&self.etcd_ca, &file.etcd_ca);
        let cert = pick(&self.etcd_cert, &file.etcd_cert);
        let key = pick(&self.etcd_key, &file.etcd_key);
        let identity = match (cert, key) {
            (Some(c), Some(k)) => Some((c, k)),
            (None, None) => None,
            _ => return Err(bad("--etcd-cert and --etcd-key go together".into())),
        };
        // A password flag (or file flag) overrides the file's keys.
        let password = match password_source(&self.etcd_password, &self.etcd_password_file)? {
            Some(source) => Some(source),
            None => password_source(&file.etcd_password, &file.etcd_password_file)?,
        };
        let user = match (self.etcd_user.clone().or(file.etcd_user.clone()), password) {
            (Some(u), Some(p)) => Some((u, p.read()?)),
            (None, None) => None,
            _ => {
                return Err(bad(
                    "--etcd-user and --etcd-password (or --etcd-password-file) go together".into(),
                ));
            }
        };
        let etcd = if endpoints.is_empty() {
            if ca.is_some() || identity.is_some() || user.is_some() {
                return Err(bad(
                    "etcd TLS or user settings without --etcd-endpoints".into()
                ));
            }
            None
        } else {
            Some(EtcdSettings {
                endpoints,
                ca,
                identity,
                user,
            })
        };
        let max_removal_percent = self
            .max_removal_percent
            .or(file.max_removal_percent)
            .unwrap_or(DEFAULT_MAX_REMOVAL_PERCENT);
        if !(1..=100).contains(&max_removal_percent) {
            return Err(bad(format!(
                "max removal percent {max_removal_percent} out of range (expected 1..=100)"
            )));
        }
        Ok(Discovery {
            etcd,
            max_removal_percent,
        })
    }
}

/// Where the etcd password comes from: given as text, or a file to read.
enum PasswordSource<'a> {
    Text(&'a str),
    File(&'a std::path::Path),
}

/// The password one layer (the flags, or the config file) names: the text
/// or the file, not both.
fn password_source<'a>(
    text: &'a Option<String>,
    file: &'a Option<PathBuf>,
) -> Result<Option<PasswordSource<'a>>, ConfigError> {
    match (text, file) {
        (Some(_), Some(_)) => Err(bad(
            "an etcd password and an etcd password file: give one".into()
        )),
        (Some(text), None) => Ok(Some(PasswordSource::Text(text))),
        (None, Some(path)) => Ok(Some(PasswordSource::File(path))),
        (None, None) => Ok(None),
    }
}

impl PasswordSource<'_> {
    /// The password: the text, or the file's first line (without its line
    /// end); an unreadable or empty file is an error that names it.
    fn read(&self) -> Result<String, ConfigError> {
        match self {
            PasswordSource::Text(text) => Ok((*text).to_string()),
            PasswordSource::File(path) => {
                let text = std::fs::read_to_string(path).map_err(|e| {
                    bad(format!(
                        "cannot read the etcd password file {}: {e}",
                        path.display()
                    ))
                })?;
                let line = text.lines().next().unwrap_or_default();
                if line.is_empty() {
                    return Err(bad(format!(
                        "the etcd password file {} is empty (its first line is the password)",
                        path.display()
                    )));
                }
                Ok(line.to_string())
            }
        }
    }
}

/// `lb-user register`: keep this backend's key under a prefix while it lives.
#[derive(Clone, Debug, Args)]
pub struct RegisterArgs {
    /// etcd v3 endpoints, URL[,URL…].
    #[arg(
        long,
        value_name = "URL[,URL…]",
        value_delimiter = ',',
        required = true
    )]
    pub etcd_endpoints: Vec<String>,
    /// CA certificate (PEM) for etcd's server certificate.
    #[arg(long, value_name = "FILE")]
    pub etcd_ca: Option<PathBuf>,
    /// Client certificate (PEM), with --etcd-key.
    #[arg(long, value_name = "FILE")]
    pub etcd_cert: Option<PathBuf>,
    /// Client key (PEM), with --etcd-cert.
    #[arg(long, value_name = "FILE")]
    pub etcd_key: Option<PathBuf>,
    /// etcd user name (with --etcd-password).
    #[arg(long, value_name = "NAME")]
    pub etcd_user: Option<String>,
    /// etcd password (every local user sees it in the process list: prefer
    /// --etcd-password-file).
    #[arg(long, value_name = "TEXT")]
    pub etcd_password: Option<String>,
    /// File whose first line is the etcd password (a systemd credential, a
    /// mounted secret).
    #[arg(long, value_name = "FILE", conflicts_with = "etcd_password")]
    pub etcd_password_file: Option<PathBuf>,
    /// The balancers' prefix; the key is PREFIX + IP:PORT.
    #[arg(long, value_name = "PREFIX")]
    pub prefix: String,
    /// This backend, IP:PORT: a host's address, as the balancers take a
    /// backend's (they skip any other).
    #[arg(long, value_name = "IP:PORT", value_parser = parse_registered_addr)]
    pub addr: std::net::SocketAddr,
    /// Weight, 1..=65535.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=65535))]
    pub weight: u32,
    /// Zone name, for zone-aware routing (A-Z a-z 0-9 . _ -, at most 63
    /// characters; empty: none).
    #[arg(long, value_name = "NAME")]
    pub zone: Option<String>,
    /// Lease time to live: the key vanishes this long after the sidecar dies.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = crate::settings::duration::parse_duration)]
    pub ttl: std::time::Duration,
    /// Registered only while GET URL answers 2xx (http://IP:PORT/path).
    #[arg(long, value_name = "URL")]
    pub check_http: Option<String>,
    /// Log level when RUST_LOG is unset.
    #[arg(long, value_name = "LEVEL", default_value = "info",
          value_parser = clap::builder::PossibleValuesParser::new(crate::settings::LOG_LEVELS))]
    pub log_level: String,
}

impl RegisterArgs {
    /// The etcd settings these flags name, validated.
    pub fn etcd(&self) -> Result<EtcdSettings, ConfigError> {
        check_prefix(&self.prefix)?;
        if self.ttl < std::time::Duration::from_secs(1) {
            return Err(bad("--ttl must be at least 1s".into()));
        }
        let args = DiscoveryArgs {
            etcd_endpoints: self.etcd_endpoints.clone(),
            etcd_ca: self.etcd_ca.clone(),
            etcd_cert: self.etcd_cert.clone(),
            etcd_key: self.etcd_key.clone(),
            etcd_user: self.etcd_user.clone(),
            etcd_password: self.etcd_password.clone(),
            etcd_password_file: self.etcd_password_file.clone(),
            ..DiscoveryArgs::default()
        };
        args.resolve(&FileDiscovery::default())?
            .etcd
            .ok_or_else(|| bad("register needs --etcd-endpoints".into()))
    }

    /// `--zone`, checked as the balancer's `--zone` is (an empty one is
    /// no zone).
    pub fn zone(&self) -> Result<Option<ZoneName>, ConfigError> {
        match self.zone.as_deref() {
            None | Some("") => Ok(None),
            Some(z) => z
                .parse()
                .map(Some)
                .map_err(|e| bad(format!("invalid --zone: {e}"))),
        }
    }
}

/// `register --addr`: the rules a balancer's discovery applies to the
/// value (`discover::entry::parse`), so that the sidecar refuses at once a
/// backend every balancer would skip, instead of keeping its lease alive.
fn parse_registered_addr(text: &str) -> Result<std::net::SocketAddr, String> {
    let addr = crate::settings::addr::parse_socket_addr(text).map_err(|e| e.to_string())?;
    match crate::settings::addr::not_a_host(addr.ip()) {
        Some(what) => Err(format!("{addr} is {what}: balancers skip it as a backend")),
        None => Ok(addr),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `register` with its etcd endpoint and prefix, `--addr addr`, and
    /// `more` flags.
    fn register(addr: &str, more: &[&str]) -> Result<RegisterArgs, clap::Error> {
        use clap::Parser;
        #[derive(Parser)]
        struct Cmd {
            #[command(flatten)]
            args: RegisterArgs,
        }
        let fixed = [
            "register",
            "--etcd-endpoints",
            "http://10.0.0.1:2379",
            "--prefix",
            "/lb/web/",
            "--addr",
            addr,
        ];
        Cmd::try_parse_from(fixed.iter().chain(more)).map(|c| c.args)
    }

    /// The sidecar refuses a backend address every balancer would skip
    /// (`discover::entry::parse`), rather than keep its lease alive.
    #[test]
    fn register_refuses_an_address_no_balancer_takes() {
        let addr = |a: &str| register(a, &[]).map(|args| args.addr);
        assert_eq!(addr("10.0.0.21:80").unwrap().to_string(), "10.0.0.21:80");
        for bad in [
            "0.0.0.0:80",
            "10.0.0.21:0",
            "224.0.0.1:80",
            "127.0.0.1:80",
            "[fe80::1%2]:80",
            "[::]:80",
        ] {
            let e = addr(bad).expect_err(bad).to_string();
            assert!(e.contains("--addr"), "{bad}: {e}");
        }
    }

    #[test]
    fn the_register_zone_is_checked_and_empty_means_none() {
        let zone = |z: &str| register("10.0.0.21:80", &["--zone", z]).unwrap().zone();
        assert_eq!(zone("eu-1").unwrap().unwrap().as_str(), "eu-1");
        assert_eq!(zone("").unwrap(), None);
        assert_eq!(
            zone("eu 1").unwrap_err().to_string(),
            "invalid --zone: zone name \"eu 1\" may only use A-Z, a-z, 0-9, '.', '_' and '-'"
        );
    }

    #[test]
    fn the_register_log_level_is_one_of_the_levels() {
        let level = |l: &str| register("10.0.0.21:80", &["--log-level", l]).map(|a| a.log_level);
        assert_eq!(level("debug").unwrap(), "debug");
        // Taken as a target name by the log filter, it logged nothing.
        let error = level("warning").expect_err("refused").to_string();
        assert!(error.contains("invalid value 'warning'"), "{error}");
    }

    #[test]
    fn endpoints_come_from_the_flag_else_the_file_and_are_checked() {
        let args = DiscoveryArgs {
            etcd_endpoints: vec!["http://10.0.0.1:2379".into(), " https://h:2379".into()],
            ..Default::default()
        };
        let d = args.resolve(&FileDiscovery::default()).unwrap();
        assert_eq!(
            d.etcd.unwrap().endpoints,
            ["http://10.0.0.1:2379", "https://h:2379"]
        );
        let file = FileDiscovery {
            etcd_endpoints: Some(vec!["10.0.0.2:2379".into()]),
            ..Default::default()
        };
        let d = DiscoveryArgs::default().resolve(&file).unwrap();
        assert_eq!(d.etcd.unwrap().endpoints, ["10.0.0.2:2379"]);
        for bad in ["http://", "h:0", "h:x", "http://h", "a b:1"] {
            let args = DiscoveryArgs {
                etcd_endpoints: vec![bad.into()],
                ..Default::default()
            };
            assert!(args.resolve(&FileDiscovery::default()).is_err(), "{bad}");
        }
    }

    /// The user and password `args` over `file` resolve to (with an
    /// endpoint, so etcd is configured), or the error's text.
    fn credentials(args: DiscoveryArgs, file: &FileDiscovery) -> Result<(String, String), String> {
        let args = DiscoveryArgs {
            etcd_endpoints: vec!["h:1".into()],
            ..args
        };
        let etcd = args.resolve(file).map_err(|e| e.to_string())?.etcd.unwrap();
        Ok(etcd.user.expect("a user"))
    }

    #[test]
    fn the_etcd_password_comes_from_a_file_and_a_flag_overrides_the_config() {
        let dir = std::env::temp_dir().join(format!("lb-password-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let secret = dir.join("secret");
        // The first line is the password: its line end and what follows
        // are not (a file written with echo, or with a comment after).
        std::fs::write(&secret, "s3cret pass\r\nnot this\n").unwrap();
        let empty = dir.join("empty");
        std::fs::write(&empty, "\n").unwrap();
        let user = || Some("root".to_string());
        let from_file = |path: &std::path::Path| DiscoveryArgs {
            etcd_user: user(),
            etcd_password_file: Some(path.to_path_buf()),
            ..Default::default()
        };
        let none = FileDiscovery::default();
        assert_eq!(
            credentials(from_file(&secret), &none),
            Ok(("root".into(), "s3cret pass".into()))
        );
        // In the config file, and a flag over it (either kind).
        let config = FileDiscovery {
            etcd_user: user(),
            etcd_password_file: Some(secret.clone()),
            ..Default::default()
        };
        assert_eq!(
            credentials(DiscoveryArgs::default(), &config),
            Ok(("root".into(), "s3cret pass".into()))
        );
        let flag = DiscoveryArgs {
            etcd_password: Some("from the flag".into()),
            ..Default::default()
        };
        assert_eq!(
            credentials(flag, &config),
            Ok(("root".into(), "from the flag".into()))
        );
        let config_text = FileDiscovery {
            etcd_user: user(),
            etcd_password: Some("from the config".into()),
            ..Default::default()
        };
        assert_eq!(
            credentials(from_file(&secret), &config_text),
            Ok(("root".into(), "s3cret pass".into()))
        );
        // Errors name the file; both kinds in one layer are refused.
        let missing = dir.join("missing");
        let err = credentials(from_file(&missing), &none).unwrap_err();
        assert!(
            err.contains("cannot read the etcd password file") && err.contains("missing"),
            "{err}"
        );
        let err = credentials(from_file(&empty), &none).unwrap_err();
        assert!(err.contains("is empty"), "{err}");
        let both = FileDiscovery {
            etcd_password: Some("x".into()),
            ..config.clone()
        };
        let err = credentials(DiscoveryArgs::default(), &both).unwrap_err();
        assert!(err.contains("give one"), "{err}");
        // A password file without a user is the same error as a password.
        let no_user = DiscoveryArgs {
            etcd_user: None,
            ..from_file(&secret)
        };
        let err = credentials(no_user, &none).unwrap_err();
        assert!(err.contains("go together"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_password_flag_and_the_password_file_flag_conflict() {
        use clap::Parser;
        #[derive(Parser, Debug)]
        struct Cmd {
            #[command(flatten)]
            args: DiscoveryArgs,
        }
        let err = Cmd::try_parse_from([
            "lb-user",
            "--etcd-password",
            "x",
            "--etcd-password-file",
            "/run/secret",
        ])
        .unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::ArgumentConflict);
    }

    #[test]
    fn pairs_go_together_and_the_percent_is_bounded() {
        let base = DiscoveryArgs {
            etcd_endpoints: vec!["h:1".into()],
            ..Default::default()
        };
        let none = FileDiscovery::default();
        let half = DiscoveryArgs {
            etcd_cert: Some("c".into()),
            ..base.clone()
        };
        assert!(half.resolve(&none).is_err());
        let user = DiscoveryArgs {
            etcd_user: Some("u".into()),
            ..base.clone()
        };
        assert!(user.resolve(&none).is_err());
        let tls_alone = DiscoveryArgs {
            etcd_ca: Some("ca".into()),
            ..Default::default()
        };
        assert!(tls_alone.resolve(&none).is_err());
        for p in [0, 101] {
            let args = DiscoveryArgs {
                max_removal_percent: Some(p),
                ..base.clone()
            };
            assert!(args.resolve(&none).is_err());
        }
        let d = base.resolve(&none).unwrap();
        assert_eq!(d.max_removal_percent, DEFAULT_MAX_REMOVAL_PERCENT);
    }

    #[test]
    fn prefixes_must_be_plain() {
        assert!(check_prefix("/lb/web/").is_ok());
        assert!(check_prefix("").is_err());
        assert!(check_prefix("/a b").is_err());
    }

    mod with_config {
        use std::path::Path;

        use clap::Parser as _;

        use crate::settings::{
            cli::Cli,
            config::{Config, FileConfig},
        };

        fn flags(argv: &[&str]) -> Result<Config, String> {
            let mut full = vec!["lb-user", "--iface", "eth0"];
            full.extend_from_slice(argv);
            let args = Cli::try_parse_from(full).map_err(|e| e.to_string())?.run;
            Config::merge(args, FileConfig::default()).map_err(|e| e.to_string())
        }

        fn file(text: &str) -> Result<Config, String> {
            let file = FileConfig::parse(text, Path::new("t.toml")).map_err(|e| e.to_string())?;
            let args = Cli::try_parse_from(["lb-user", "--iface", "eth0"])
                .unwrap()
                .run;
            Config::merge(args, file).map_err(|e| e.to_string())
        }

        #[test]
        fn a_vip_with_a_prefix_needs_no_backends_and_flags_equal_the_file() {
            let c = flags(&[
                "--etcd-endpoints",
                "http://10.0.0.1:2379,http://10.0.0.2:2379",
                "--vip",
                "10.0.0.100:80",
                "--etcd-prefix",
                "/lb/web/",
                "--state-dir",
                "/tmp/x",
                "--max-removal-percent",
                "30",
            ])
            .unwrap();
            let f = file(
                r#"
etcd_endpoints = ["http://10.0.0.1:2379", "http://10.0.0.2:2379"]
state_dir = "/tmp/x"
max_removal_percent = 30
[[vip]]
address = "10.0.0.100:80"
etcd_prefix = "/lb/web/"
"#,
            )
            .unwrap();
            assert_eq!(c, f);
            assert_eq!(c.vips[0].etcd_prefix.as_deref(), Some("/lb/web/"));
            assert!(c.vips[0].backends.is_empty());
            assert_eq!(c.discovery.etcd.as_ref().unwrap().endpoints.len(), 2);
        }

        #[test]
        fn the_password_file_works_from_the_flag_and_from_the_config_file() {
            let dir = std::env::temp_dir().join(format!("lb-pw-config-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let secret = dir.join("etcd-password");
            std::fs::write(&secret, "hunter2\n").unwrap();
            let secret = secret.to_str().unwrap();
            let c = flags(&[
                "--etcd-endpoints",
                "http://10.0.0.1:2379",
                "--etcd-user",
                "lb",
                "--etcd-password-file",
                secret,
                "--vip",
                "10.0.0.100:80",
                "--etcd-prefix",
                "/lb/web/",
            ])
            .unwrap();
            let f = file(&format!(
                r#"
etcd_endpoints = ["http://10.0.0.1:2379"]
etcd_user = "lb"
etcd_password_file = "{secret}"
[[vip]]
address = "10.0.0.100:80"
etcd_prefix = "/lb/web/"
"#
            ))
            .unwrap();
            assert_eq!(c, f);
            let user = c.discovery.etcd.unwrap().user;
            assert_eq!(user, Some(("lb".to_string(), "hunter2".to_string())));
            std::fs::remove_dir_all(&dir).unwrap();
        }

        #[test]
        fn each_bad_discovery_input_is_one_clear_error() {
            let e = flags(&[
                "--etcd-endpoints",
                "http://h:2379",
                "--vip",
                "10.0.0.100:80",
                "--etcd-prefix",
                "/p/",
                "--backend",
                "10.0.0.21:80",
            ])
            .unwrap_err();
            assert!(e.contains("static backends as well are not allowed"), "{e}");
            let e = flags(&["--vip", "10.0.0.100:80", "--etcd-prefix", "/p/"]).unwrap_err();
            assert!(e.contains("no --etcd-endpoints"), "{e}");
            let e =
                flags(&["--etcd-endpoints", "http://h:2379", "--etcd-prefix", "/p/"]).unwrap_err();
            assert!(e.contains("--etcd-prefix given without --vip"), "{e}");
            let e = flags(&[
                "--etcd-endpoints",
                "nope",
                "--vip",
                "10.0.0.100:80",
                "--etcd-prefix",
                "/p/",
            ])
            .unwrap_err();
            assert!(e.contains("invalid etcd endpoint"), "{e}");
            let e = file("[[vip]]\naddress = \"10.0.0.100:80\"\netcd_prefix = \"/p/\"\nbackends = [\"10.0.0.21:80\"]\netcd_endpoints = [\"h:1\"]\n")
                .unwrap_err();
            assert!(
                e.contains("unknown field"),
                "a global key inside [[vip]]: {e}"
            );
            assert!(!e.contains('\n'));
        }
    }
}
