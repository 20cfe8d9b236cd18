//! The benchmark's markdown table and JSON file.

use std::fmt::Write as _;

use super::{RowResult, scenario::Kind};

/// The results to publish after a run: `fresh`, plus the rows of `previous`
/// (the last published file) for every scenario this run did not measure,
/// so `--scenario NAME` updates that scenario's table and keeps the others.
/// A scenario's rows always come from one run. Ordered as [`Kind::ALL`],
/// each scenario's loads in increasing order.
pub fn merge_published(previous: Vec<RowResult>, fresh: &[RowResult]) -> Vec<RowResult> {
    let mut merged: Vec<RowResult> = previous
        .into_iter()
        .filter(|old| !fresh.iter().any(|r| r.scenario == old.scenario))
        .chain(fresh.iter().cloned())
        .collect();
    let order = |r: &RowResult| match Kind::of_table(&r.scenario) {
        Some((kind, load)) => (
            Kind::ALL
                .iter()
                .position(|&k| k == kind)
                .unwrap_or(Kind::ALL.len()),
            load,
        ),
        None => (Kind::ALL.len(), 0),
    };
    merged.sort_by_key(order);
    merged
}

/// One markdown table per scenario.
pub fn markdown(results: &[RowResult]) -> String {
    let mut out = String::new();
    let mut scenarios: Vec<&str> = results.iter().map(|r| r.scenario.as_str()).collect();
    scenarios.dedup();
    for scenario in scenarios {
        let rows: Vec<&RowResult> = results.iter().filter(|r| r.scenario == scenario).collect();
        let kind = Kind::of_table(scenario).map(|(k, _)| k);
        let degrade = kind == Some(Kind::Degrade);
        let recover = kind == Some(Kind::Recover);
        let held_out = if kind.is_some_and(Kind::held_out) {
            ", held out"
        } else {
            ""
        };
        // In `zones` the "misbehaving" backends are zone b's: say so.
        let zones = rows.iter().any(|r| r.cross_zone_share.is_some());
        let share = if zones {
            "cross-zone share"
        } else {
            "slow share"
        };
        let _ = writeln!(
            out,
            "\n#### {scenario} (open loop at {:.0} req/s{held_out})\n",
            rows.first().map_or(0.0, |r| r.target_rps)
        );
        let _ = write!(
            out,
            "| row | achieved req/s | errors | SYN retrans | P50 ms | P90 ms | P99 ms | P99.9 ms | {share} | proc CPU s/10k | softirq s/10k |"
        );
        out.push_str(match (degrade, recover) {
            (true, _) => " reaction s |\n",
            (_, true) => " recovery s |\n",
            _ => "\n",
        });
        out.push_str("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        out.push_str(if degrade || recover { "---:|\n" } else { "\n" });
        for r in rows {
            let _ = write!(
                out,
                "| {} | {:.0} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1}% | {:.3} | {:.3} |",
                r.row,
                r.achieved_rps,
                r.errors,
                r.syn_retransmits
                    .map_or_else(|| "–".to_string(), |n| n.to_string()),
                r.p50_ms,
                r.p90_ms,
                r.p99_ms,
                r.p999_ms,
                r.cross_zone_share.unwrap_or(r.slow_share) * 100.0,
                r.process_cpu_s_per_10k,
                r.softirq_s_per_10k
            );
            if degrade {
                let reaction = match r.degrade_reaction_s {
                    Some(s) => format!("{s:.2}"),
                    None if r.row.starts_with("oracle") => "n/a".into(),
                    None => "never".into(),
                };
                let _ = write!(out, " {reaction} |");
            }
            if recover {
                let recovery = match r.recovery_s {
                    Some(s) => format!("{s:.2}"),
                    None if r.row.starts_with("oracle") => "n/a".into(),
                    None => "never".into(),
                };
                let _ = write!(out, " {recovery} |");
            }
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(scenario: &str, name: &str) -> RowResult {
        RowResult {
            scenario: scenario.into(),
            row: name.into(),
            target_rps: 1000.0,
            achieved_rps: 999.0,
            completed: 10,
            errors: 0,
            syn_retransmits: Some(2),
            error_kinds: Default::default(),
            p50_ms: 1.0,
            p90_ms: 2.0,
            p99_ms: 3.0,
            p999_ms: 4.0,
            slow_share: 0.25,
            cross_zone_share: (scenario == "zones").then_some(0.125),
            process_cpu_s_per_10k: 0.5,
            softirq_s_per_10k: 0.25,
            degrade_reaction_s: None,
            recovery_s: None,
            cdf: Vec::new(),
        }
    }

    #[test]
    fn a_table_per_scenario_with_reaction_only_for_degrade() {
        let md = markdown(&[
            row("hetero", "lb p2c-ewma"),
            row("degrade", "haproxy roundrobin"),
        ]);
        assert!(md.contains("#### hetero"));
        assert!(md.contains(
            "| lb p2c-ewma | 999 | 0 | 2 | 1.0 | 2.0 | 3.0 | 4.0 | 25.0% | 0.500 | 0.250 |\n"
        ));
        assert!(md.contains("| haproxy roundrobin | 999 | 0 | 2 | 1.0 | 2.0 | 3.0 | 4.0 | 25.0% | 0.500 | 0.250 | never |"));
    }

    #[test]
    fn zones_shows_the_cross_zone_share_under_its_own_name() {
        let md = markdown(&[row("stall", "lb p2c-ewma"), row("zones", "lb p2c-ewma")]);
        let (stall, zones) = md.split_once("#### zones").unwrap();
        assert!(stall.contains("| slow share |"));
        assert!(stall.contains("| 25.0% |"));
        assert!(zones.contains("| cross-zone share |"));
        assert!(!zones.contains("slow share"));
        assert!(zones.contains(
            "| lb p2c-ewma | 999 | 0 | 2 | 1.0 | 2.0 | 3.0 | 4.0 | 12.5% | 0.500 | 0.250 |\n"
        ));
    }

    #[test]
    fn loads_and_held_out_scenarios_get_their_own_tables_in_order() {
        let previous = vec![row("hetero", "old"), row("big-slow", "old")];
        let fresh = [
            row("hetero at 85%", "new"),
            row("degrade at 85%", "new"),
            row("hetero-20", "new"),
        ];
        let merged = merge_published(previous, &fresh);
        let got: Vec<&str> = merged.iter().map(|r| r.scenario.as_str()).collect();
        assert_eq!(
            got,
            [
                "hetero",
                "hetero at 85%",
                "degrade at 85%",
                "hetero-20",
                "big-slow"
            ]
        );
        let md = markdown(&merged);
        assert!(md.contains("#### hetero at 85% (open loop at 1000 req/s)\n"));
        assert!(md.contains("#### hetero-20 (open loop at 1000 req/s, held out)\n"));
        assert!(md.contains("#### big-slow (open loop at 1000 req/s, held out)\n"));
        let degrade = md.split("#### degrade at 85%").nth(1).unwrap();
        assert!(degrade.contains(" reaction s |"));
        assert!(
            !md.split("#### degrade")
                .next()
                .unwrap()
                .contains("reaction s")
        );
    }

    #[test]
    fn a_partial_run_replaces_only_its_scenarios() {
        let previous = vec![
            row("hetero", "old"),
            row("zones", "old"),
            row("degrade", "old"),
        ];
        let merged = merge_published(previous, &[row("zones", "new a"), row("zones", "new b")]);
        let got: Vec<(&str, &str)> = merged
            .iter()
            .map(|r| (r.scenario.as_str(), r.row.as_str()))
            .collect();
        assert_eq!(
            got,
            [
                ("hetero", "old"),
                ("degrade", "old"),
                ("zones", "new a"),
                ("zones", "new b")
            ]
        );
    }

    #[test]
    fn results_without_a_cross_zone_share_read_back_and_write_unchanged() {
        // The published file predates `cross_zone_share`.
        let mut json = serde_json::to_value(row("hetero", "x")).unwrap();
        assert!(json.get("cross_zone_share").is_none());
        json.as_object_mut().unwrap().remove("cross_zone_share");
        let back: RowResult = serde_json::from_value(json.clone()).unwrap();
        assert_eq!(back.cross_zone_share, None);
        assert_eq!(serde_json::to_value(&back).unwrap(), json);
    }

    #[test]
    fn published_floats_read_back_bit_for_bit() {
        // Without serde_json's float_roundtrip these come back one ulp off,
        // and merging a partial run would rewrite every published number.
        for text in [
            "0.9450000000000001",
            "921.5333333333333",
            "0.0015098722415795587",
        ] {
            let x: f64 = serde_json::from_str(text).unwrap();
            assert_eq!(serde_json::to_string(&x).unwrap(), text);
        }
    }
}
