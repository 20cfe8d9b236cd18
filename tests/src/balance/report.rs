//! The benchmark's markdown table and JSON file.

use std::fmt::Write as _;

use super::RowResult;

/// One markdown table per scenario.
pub fn markdown(results: &[RowResult]) -> String {
    let mut out = String::new();
    let mut scenarios: Vec<&str> = results.iter().map(|r| r.scenario.as_str()).collect();
    scenarios.dedup();
    for scenario in scenarios {
        let rows: Vec<&RowResult> = results.iter().filter(|r| r.scenario == scenario).collect();
        let degrade = rows.iter().any(|r| r.scenario == "degrade");
        let _ = writeln!(
            out,
            "\n#### {scenario} (open loop at {:.0} req/s)\n",
            rows.first().map_or(0.0, |r| r.target_rps)
        );
        let _ = write!(
            out,
            "| row | achieved req/s | errors | P50 ms | P90 ms | P99 ms | P99.9 ms | slow share | proc CPU s/10k | softirq s/10k |"
        );
        out.push_str(if degrade { " reaction s |\n" } else { "\n" });
        out.push_str("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        out.push_str(if degrade { "---:|\n" } else { "\n" });
        for r in rows {
            let _ = write!(
                out,
                "| {} | {:.0} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1}% | {:.3} | {:.3} |",
                r.row,
                r.achieved_rps,
                r.errors,
                r.p50_ms,
                r.p90_ms,
                r.p99_ms,
                r.p999_ms,
                r.slow_share * 100.0,
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
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_per_scenario_with_reaction_only_for_degrade() {
        let row = |scenario: &str, name: &str| RowResult {
            scenario: scenario.into(),
            row: name.into(),
            target_rps: 1000.0,
            achieved_rps: 999.0,
            completed: 10,
            errors: 0,
            error_kinds: Default::default(),
            p50_ms: 1.0,
            p90_ms: 2.0,
            p99_ms: 3.0,
            p999_ms: 4.0,
            slow_share: 0.25,
            process_cpu_s_per_10k: 0.5,
            softirq_s_per_10k: 0.25,
            degrade_reaction_s: None,
            cdf: Vec::new(),
        };
        let md = markdown(&[
            row("hetero", "lb p2c-ewma"),
            row("degrade", "haproxy roundrobin"),
        ]);
        assert!(md.contains("#### hetero"));
        assert!(md.contains(
            "| lb p2c-ewma | 999 | 0 | 1.0 | 2.0 | 3.0 | 4.0 | 25.0% | 0.500 | 0.250 |\n"
        ));
        assert!(md.contains("| haproxy roundrobin | 999 | 0 | 1.0 | 2.0 | 3.0 | 4.0 | 25.0% | 0.500 | 0.250 | never |"));
    }
}
