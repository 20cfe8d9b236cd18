//! The README's benchmark tables are the published ones: its generated
//! section holds `docs/bench/balance.md` as it is, and that file is what
//! `docs/bench/balance.json` renders to. A hand edit of either, or a run
//! that published without rewriting the README, fails here.

use std::path::Path;

use lb_lab::{
    balance::{RowResult, report},
    readme,
};

fn published(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../docs/bench")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

#[test]
fn readme_holds_the_published_balance_tables() {
    let path = readme::workspace_readme();
    let text = std::fs::read_to_string(&path).expect("reading the README");
    let section = readme::section(&text, readme::BALANCE_SECTION).expect("the generated section");
    let md = published("balance.md");
    assert_eq!(
        section.trim(),
        md.trim(),
        "the README's balance tables differ from docs/bench/balance.md: \
         run `cargo xtask bench balance` or copy the file into the section"
    );
}

#[test]
fn published_balance_tables_render_from_the_json() {
    let rows: Vec<RowResult> =
        serde_json::from_str(&published("balance.json")).expect("parsing balance.json");
    assert!(!rows.is_empty());
    assert_eq!(
        report::markdown(&rows).trim(),
        published("balance.md").trim(),
        "docs/bench/balance.md is not what balance.json renders to"
    );
}
