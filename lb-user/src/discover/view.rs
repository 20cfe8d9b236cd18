//! The keys under one VIP's prefix, as of a revision: built from a
//! snapshot, changed by watch events, and turned into the wanted backends.
//! A key whose value is bad is skipped (its last good value, if any, is
//! kept, through a re-read of the prefix too), so a bad write never
//! removes a backend. A value naming a backend at a SNAT address is such
//! a bad value: the pools are known here, so it is skipped like the rest.

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
};

use super::entry::{self, Entry};
use crate::settings::{addr::VipAddr, config::check_backend_snat};

/// A key or value that was skipped, as one log line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Skipped {
    pub key: String,
    pub reason: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefixView {
    pub prefix: String,
    /// The VIP whose backends the keys name (they must meet a configured
    /// backend's rules: `config::check_backend`).
    pub vip: VipAddr,
    /// The SNAT addresses the kernel has (both families): a backend at
    /// one is a bad value (`config::check_backend_snat`).
    pub snat: Vec<IpAddr>,
    /// The etcd revision this view reflects.
    pub revision: i64,
    entries: BTreeMap<String, Entry>,
}

impl PrefixView {
    pub fn new(prefix: &str, vip: VipAddr, snat: &[IpAddr]) -> Self {
        Self {
            prefix: prefix.to_string(),
            vip,
            snat: snat.to_vec(),
            revision: 0,
            entries: BTreeMap::new(),
        }
    }

    /// The view a cache kept: `keys` and their last good values at
    /// `revision`. A value that no longer meets the rules (a cache written
    /// by an older build, or edited, or a backend at a SNAT address given
    /// since) is left out, and returned.
    pub fn cached(
        prefix: &str,
        vip: VipAddr,
        snat: &[IpAddr],
        revision: i64,
        keys: &BTreeMap<String, Entry>,
    ) -> (Self, Vec<Skipped>) {
        let mut view = Self::new(prefix, vip, snat);
        let mut skipped = Vec::new();
        for (key, e) in keys {
            if let Ok(value) = serde_json::to_vec(e)
                && let Err(s) = view.put(key.as_bytes(), &value)
            {
                skipped.push(s);
            }
        }
        view.revision = revision;
        (view, skipped)
    }

    /// Every key with its good value.
    pub fn keys(&self) -> &BTreeMap<String, Entry> {
        &self.entries
    }

    /// A view with these keys at `revision`; the bad ones are returned.
    pub fn snapshot(
        prefix: &str,
        vip: VipAddr,
        snat: &[IpAddr],
        revision: i64,
        kvs: impl IntoIterator<Item = (Vec<u8>, Vec<u8>)>,
    ) -> (Self, Vec<Skipped>) {
        Self::new(prefix, vip, snat).reread(revision, kvs)
    }

    /// A new view of this prefix from a re-read of its keys at `revision`
    /// (after a compaction or a rewound etcd); the bad ones are returned. A
    /// key still there whose value is now bad keeps this view's good
    /// value, as a watched bad write does: dropping it here would remove a
    /// backend that the balancers still watching keep, for good.
    pub fn reread(
        &self,
        revision: i64,
        kvs: impl IntoIterator<Item = (Vec<u8>, Vec<u8>)>,
    ) -> (Self, Vec<Skipped>) {
        let mut view = Self::new(&self.prefix, self.vip, &self.snat);
        let mut skipped = Vec::new();
        for (key, value) in kvs {
            if let Err(s) = view.put(&key, &value) {
                view.keep_last_good(self, &key);
                skipped.push(s);
            }
        }
        view.revision = revision;
        (view, skipped)
    }

    /// Takes `last`'s entry of `key`, if it had a good one.
    fn keep_last_good(&mut self, last: &PrefixView, key: &[u8]) {
        let Ok(name) = std::str::from_utf8(key) else {
            return;
        };
        if let Some(e) = last.entries.get(name) {
            self.entries.insert(name.to_string(), e.clone());
        }
    }

    /// A key was written: its value must meet a backend's rules, those
    /// against the SNAT pools included ([`Self::snat`]).
    pub fn put(&mut self, key: &[u8], value: &[u8]) -> Result<(), Skipped> {
        let name = String::from_utf8_lossy(key).into_owned();
        if std::str::from_utf8(key).is_err() || !name.starts_with(&self.prefix) {
            return Err(Skipped {
                key: name,
                reason: "key is not UTF-8 under the prefix".into(),
            });
        }
        let parsed = entry::parse(value, &self.vip).and_then(|e| {
            check_backend_snat(&self.vip, e.addr, &self.snat)
                .map(|()| e)
                .map_err(|err| err.to_string())
        });
        match parsed {
            Ok(e) => {
                self.entries.insert(name, e);
                Ok(())
            }
            Err(reason) => Err(Skipped { key: name, reason }),
        }
    }

    /// A key was deleted (or its lease expired); true if it named a
    /// backend.
    pub fn delete(&mut self, key: &[u8]) -> bool {
        self.entries
            .remove(String::from_utf8_lossy(key).as_ref())
            .is_some()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The wanted backends in address order (so every balancer sees the
    /// same order); of two keys naming one address, the first key wins.
    pub fn wanted(&self) -> Vec<Entry> {
        let mut by_addr: BTreeMap<SocketAddr, Entry> = BTreeMap::new();
        for e in self.entries.values() {
            by_addr.entry(e.addr).or_insert_with(|| e.clone());
        }
        by_addr.into_values().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(k: &str, v: &str) -> (Vec<u8>, Vec<u8>) {
        (k.as_bytes().to_vec(), v.as_bytes().to_vec())
    }

    #[test]
    fn a_snapshot_skips_bad_values_and_keeps_the_rest_in_address_order() {
        let (view, skipped) = PrefixView::snapshot(
            "/lb/web/",
            "10.0.0.1:80".parse().unwrap(),
            &[],
            42,
            [
                kv("/lb/web/b", r#"{"addr":"10.0.0.22:80","weight":2}"#),
                kv("/lb/web/a", r#"{"addr":"10.0.0.21:80"}"#),
                kv("/lb/web/c", "garbage"),
                kv("/lb/web/d", r#"{"addr":"10.0.0.21:80","weight":9}"#),
            ],
        );
        assert_eq!(view.revision, 42);
        assert_eq!(skipped.len(), 1);
        assert_eq!(skipped[0].key, "/lb/web/c");
        let wanted = view.wanted();
        let addrs: Vec<String> = wanted.iter().map(|e| e.addr.to_string()).collect();
        assert_eq!(addrs, ["10.0.0.21:80", "10.0.0.22:80"]);
        assert_eq!(wanted[0].weight, 1, "key a wins over key d");
    }

    #[test]
    fn a_bad_write_keeps_the_last_good_value_and_a_delete_removes() {
        let mut view = PrefixView::new("/p/", "10.0.0.1:80".parse().unwrap(), &[]);
        view.put(b"/p/x", br#"{"addr":"10.0.0.21:80","weight":3}"#)
            .unwrap();
        assert!(
            view.put(b"/p/x", br#"{"addr":"10.0.0.21:80","weight":0}"#)
                .is_err()
        );
        assert_eq!(view.wanted()[0].weight, 3);
        assert!(view.put(b"/other/x", br#"{"addr":"10.0.0.9:80"}"#).is_err());
        view.delete(b"/p/x");
        assert!(view.is_empty());
    }

    #[test]
    fn a_reread_keeps_the_last_good_value_of_a_key_now_bad() {
        let vip: VipAddr = "10.0.0.1:80".parse().unwrap();
        let (view, _) = PrefixView::snapshot(
            "/p/",
            vip,
            &[],
            5,
            [
                kv("/p/x", r#"{"addr":"10.0.0.21:80","weight":3}"#),
                kv("/p/y", r#"{"addr":"10.0.0.22:80"}"#),
            ],
        );
        let (again, skipped) = view.reread(
            9,
            [
                kv("/p/x", r#"{"addr":"10.0.0.21:80","weight":0}"#),
                kv("/p/y", r#"{"addr":"10.0.0.22:80"}"#),
            ],
        );
        assert_eq!(skipped.len(), 1, "still reported as bad");
        assert_eq!(again.revision, 9);
        assert_eq!(again.wanted(), view.wanted());
        // A key gone is gone; a new bad key has nothing to keep.
        let (again, _) = view.reread(
            10,
            [kv("/p/y", r#"{"addr":"10.0.0.22:80"}"#), kv("/p/z", "bad")],
        );
        let addrs: Vec<String> = again.wanted().iter().map(|e| e.addr.to_string()).collect();
        assert_eq!(addrs, ["10.0.0.22:80"]);
    }

    #[test]
    fn a_cached_view_keeps_its_keys_good_values_through_a_read_of_bad_ones() {
        let vip: VipAddr = "10.0.0.1:80".parse().unwrap();
        let (view, _) = PrefixView::snapshot(
            "/p/",
            vip,
            &[],
            5,
            [
                kv("/p/x", r#"{"addr":"10.0.0.21:80","weight":3}"#),
                kv("/p/y", r#"{"addr":"10.0.0.22:80"}"#),
            ],
        );
        // What a restart has of it: the cache's keys; one cached value
        // broke a rule of this build (a multicast address) and is dropped.
        let mut keys = view.keys().clone();
        keys.insert(
            "/p/m".into(),
            Entry {
                addr: "224.0.0.9:80".parse().unwrap(),
                weight: 1,
                zone: None,
            },
        );
        let (cached, skipped) = PrefixView::cached("/p/", vip, &[], 5, &keys);
        assert_eq!(cached.keys(), view.keys());
        // Returned, for the start to say so.
        assert_eq!(skipped.len(), 1);
        assert_eq!(skipped[0].key, "/p/m");
        // etcd now holds a bad value for x: the restart keeps x's cached one.
        let (read, skipped) = cached.reread(
            9,
            [
                kv("/p/x", "{not json"),
                kv("/p/y", r#"{"addr":"10.0.0.22:80"}"#),
            ],
        );
        assert_eq!(skipped.len(), 1);
        assert_eq!(read.wanted(), view.wanted());
    }

    #[test]
    fn a_value_at_a_snat_address_is_skipped_and_the_key_keeps_its_last_good_value() {
        let vip: VipAddr = "10.0.0.100:80".parse().unwrap();
        let snat: Vec<IpAddr> = vec!["10.0.0.1".parse().unwrap(), "fd00::1".parse().unwrap()];
        let (mut view, skipped) = PrefixView::snapshot(
            "/p/",
            vip,
            &snat,
            5,
            [
                kv("/p/x", r#"{"addr":"10.0.0.21:80","weight":3}"#),
                kv("/p/s", r#"{"addr":"10.0.0.1:80"}"#),
            ],
        );
        assert_eq!(skipped.len(), 1);
        assert_eq!(skipped[0].key, "/p/s");
        assert!(
            skipped[0]
                .reason
                .starts_with("backend 10.0.0.1:80 of VIP 10.0.0.100:80/tcp is at SNAT address"),
            "{}",
            skipped[0].reason
        );
        let good = view.wanted();
        assert_eq!(good.len(), 1);
        // x rewritten to the SNAT address: refused, x keeps 10.0.0.21:80.
        let s = view
            .put(b"/p/x", br#"{"addr":"10.0.0.1:8080"}"#)
            .unwrap_err();
        assert_eq!(s.key, "/p/x");
        assert!(s.reason.contains("is at SNAT address 10.0.0.1"), "{s:?}");
        assert_eq!(view.wanted(), good);
        // So does a re-read that finds it there.
        let (again, skipped) = view.reread(9, [kv("/p/x", r#"{"addr":"10.0.0.1:8080"}"#)]);
        assert_eq!(skipped.len(), 1);
        assert_eq!(again.wanted(), good);
        // A cached value at an address that has become a SNAT one is left out.
        let (cached, skipped) =
            PrefixView::cached("/p/", vip, &["10.0.0.21".parse().unwrap()], 9, view.keys());
        assert!(cached.is_empty());
        assert_eq!(skipped.len(), 1);
        assert!(
            skipped[0].reason.contains("is at SNAT address 10.0.0.21"),
            "{skipped:?}"
        );
    }
}
