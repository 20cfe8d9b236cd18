//! The last known backends of every discovered VIP, in
//! `<state dir>/discovery-<instance>.json`, written atomically (a temporary
//! file in the same folder, synced, then renamed over the old one), so a
//! balancer restarted while etcd is down serves what it served before.

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
};

use anyhow::Context as _;
use serde::{Deserialize, Serialize};

use super::entry::Entry;

/// One VIP's last known backends.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CachedVip {
    pub prefix: String,
    pub revision: i64,
    pub backends: Vec<Entry>,
    /// The keys they came from, each with its last good value: a restart
    /// that finds a key's value bad in etcd keeps the value cached here, as
    /// a balancer that watched the bad write keeps its own (empty in a
    /// cache written before keys were kept).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub keys: BTreeMap<String, Entry>,
}

/// Keyed by the VIP's text form (`IP:PORT/proto`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cache {
    pub vips: BTreeMap<String, CachedVip>,
}

pub fn path(state_dir: &Path, instance: &str) -> PathBuf {
    state_dir.join(format!("discovery-{instance}.json"))
}

impl Cache {
    /// The cache, or `None` when there is none (or it cannot be read,
    /// which is logged by the caller as "no cache").
    pub fn load(path: &Path) -> anyhow::Result<Option<Self>> {
        let text = match fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        };
        let cache =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        Ok(Some(cache))
    }

    /// Replaces the file atomically.
    pub fn store(&self, path: &Path) -> anyhow::Result<()> {
        let text = serde_json::to_vec_pretty(self)?;
        crate::kernel::instance::write_durable(path, &text)
            .with_context(|| format!("writing {}", path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stores_and_loads_and_a_missing_file_is_none() {
        let dir = std::env::temp_dir().join(format!("lb-cache-test-{}", std::process::id()));
        let p = path(&dir, "lb-x");
        assert_eq!(Cache::load(&p).unwrap(), None);
        let mut cache = Cache::default();
        let entry = Entry {
            addr: "10.0.0.21:80".parse().unwrap(),
            weight: 2,
            zone: Some("a".parse().unwrap()),
        };
        cache.vips.insert(
            "10.0.0.100:80/tcp".into(),
            CachedVip {
                prefix: "/lb/web/".into(),
                revision: 7,
                backends: vec![entry.clone()],
                keys: BTreeMap::from([("/lb/web/a".to_string(), entry)]),
            },
        );
        cache.store(&p).unwrap();
        assert_eq!(Cache::load(&p).unwrap(), Some(cache.clone()));
        // A cache written before keys were kept loads with none.
        fs::write(
            &p,
            r#"{"vips":{"10.0.0.100:80/tcp":{"prefix":"/lb/web/","revision":7,
               "backends":[{"addr":"10.0.0.21:80","weight":2}]}}}"#,
        )
        .unwrap();
        let old = Cache::load(&p).unwrap().unwrap();
        assert!(old.vips["10.0.0.100:80/tcp"].keys.is_empty());
        assert_eq!(old.vips["10.0.0.100:80/tcp"].backends.len(), 1);
        cache.vips.clear();
        cache.store(&p).unwrap();
        assert_eq!(Cache::load(&p).unwrap(), Some(cache));
        fs::write(&p, "{").unwrap();
        assert!(Cache::load(&p).is_err());
        let _ = fs::remove_dir_all(&dir);
    }
}
