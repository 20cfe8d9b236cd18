//! Sections of the README that a benchmark writes, so that the tables it
//! shows are always those of the published files in `docs/bench/`.
//!
//! A section sits between two marker lines:
//!
//! ```text
//! <!-- begin generated: NAME (do not edit by hand) -->
//! ...
//! <!-- end generated: NAME -->
//! ```
//!
//! [`splice`] replaces what lies between them; [`section`] reads it back
//! (the check that the README matches `docs/bench/`).

use std::path::Path;

use anyhow::{Context, Result, bail};

/// The section the balancing benchmark writes: `docs/bench/balance.md`.
pub const BALANCE_SECTION: &str = "cargo xtask bench balance";

/// The README at the workspace's root.
pub fn workspace_readme() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md")
}

fn begin_marker(name: &str) -> String {
    format!("<!-- begin generated: {name} (do not edit by hand) -->")
}

fn end_marker(name: &str) -> String {
    format!("<!-- end generated: {name} -->")
}

/// Byte ranges of the section's body (between the end of the begin
/// marker's line and the start of the end marker's line).
fn body_range(text: &str, name: &str) -> Result<std::ops::Range<usize>> {
    let begin = begin_marker(name);
    let end = end_marker(name);
    let line_at = |marker: &str| -> Result<usize> {
        let mut found = text.match_indices(marker).filter(|&(at, _)| {
            // A marker counts only as a whole line of its own.
            let starts_line = at == 0 || text.as_bytes()[at - 1] == b'\n';
            let rest = &text[at + marker.len()..];
            starts_line && (rest.is_empty() || rest.starts_with('\n'))
        });
        let Some((at, _)) = found.next() else {
            bail!("the README has no line `{marker}`");
        };
        if found.next().is_some() {
            bail!("the README has the line `{marker}` more than once");
        }
        Ok(at)
    };
    let begin_at = line_at(&begin)?;
    let end_at = line_at(&end)?;
    let body_start = (begin_at + begin.len() + 1).min(text.len());
    if end_at < body_start {
        bail!("the README's `{end}` comes before `{begin}`");
    }
    Ok(body_start..end_at)
}

/// The text of section `name` of `text`.
pub fn section<'a>(text: &'a str, name: &str) -> Result<&'a str> {
    Ok(&text[body_range(text, name)?])
}

/// `text` with section `name`'s body replaced by `content` (ending with
/// one newline); everything outside the markers is kept byte for byte.
pub fn splice(text: &str, name: &str, content: &str) -> Result<String> {
    let range = body_range(text, name)?;
    let mut out = String::with_capacity(text.len() + content.len());
    out.push_str(&text[..range.start]);
    out.push_str(content.trim_end_matches('\n'));
    out.push('\n');
    out.push_str(&text[range.end..]);
    Ok(out)
}

/// Rewrites section `name` of the README at `path` with `content`.
pub fn update_file(path: &Path, name: &str, content: &str) -> Result<()> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let updated = splice(&text, name, content)
        .with_context(|| format!("updating section '{name}' of {}", path.display()))?;
    if updated != text {
        std::fs::write(path, updated).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc(body: &str) -> String {
        format!(
            "# Title\n\nbefore\n{}\n{body}{}\nafter\n",
            begin_marker("x"),
            end_marker("x")
        )
    }

    #[test]
    fn splice_replaces_only_the_body() {
        let text = doc("old table\nold row\n");
        let out = splice(&text, "x", "new table\n\n").unwrap();
        assert_eq!(out, doc("new table\n"));
        assert_eq!(section(&out, "x").unwrap(), "new table\n");
        // Idempotent.
        assert_eq!(splice(&out, "x", "new table").unwrap(), out);
    }

    #[test]
    fn splice_fills_an_empty_section() {
        let text = doc("");
        assert_eq!(section(&text, "x").unwrap(), "");
        assert_eq!(splice(&text, "x", "t").unwrap(), doc("t\n"));
    }

    #[test]
    fn missing_repeated_or_reversed_markers_are_errors() {
        let err = splice("no markers\n", "x", "t").unwrap_err().to_string();
        assert!(err.contains("has no line"), "{err}");
        let twice = format!("{}\n{}", doc(""), begin_marker("x"));
        let err = splice(&twice, "x", "t").unwrap_err().to_string();
        assert!(err.contains("more than once"), "{err}");
        let reversed = format!("{}\n{}\n", end_marker("x"), begin_marker("x"));
        let err = splice(&reversed, "x", "t").unwrap_err().to_string();
        assert!(err.contains("comes before"), "{err}");
        // Another section's markers do not count.
        assert!(splice(&doc(""), "y", "t").is_err());
    }

    #[test]
    fn a_marker_inside_a_line_is_not_a_marker() {
        let text = format!("see `{}` below\n{}", begin_marker("x"), doc("b\n"));
        assert_eq!(section(&text, "x").unwrap(), "b\n");
    }
}
