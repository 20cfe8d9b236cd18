//! The shape of `src/`: only `main.rs`, `lib.rs` and folders, each folder
//! with a `mod.rs` that says what it may use, and every reference between
//! folders pointing one way, down the data's path.

use std::{
    fs,
    path::{Path, PathBuf},
};

/// The folders in data-flow order: each may use only those before it.
const ORDER: [&str; 9] = [
    "settings", "kernel", "ingest", "estimate", "pool", "publish", "surface", "discover", "daemon",
];

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The first path segment of every `crate::` reference, including each
/// item of a `use crate::{a::.., b::..}` group; comments are skipped.
fn crate_heads(text: &str) -> Vec<String> {
    let code: String = text
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    let ident = |s: &str| -> String {
        s.trim_start()
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    let mut heads = Vec::new();
    for (at, _) in code.match_indices("crate::") {
        let rest = &code[at + "crate::".len()..];
        let Some(group) = rest.strip_prefix('{') else {
            heads.push(ident(rest));
            continue;
        };
        let (mut depth, mut item) = (0, String::new());
        for c in group.chars() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => break,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    heads.push(ident(&item));
                    item.clear();
                    continue;
                }
                _ => {}
            }
            item.push(c);
        }
        heads.push(ident(&item));
    }
    heads.retain(|h| !h.is_empty());
    heads
}

#[test]
fn src_holds_only_main_lib_and_folders() {
    for entry in fs::read_dir(src()).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        assert!(
            path.is_dir() || name == "main.rs" || name == "lib.rs",
            "{name} belongs in a folder"
        );
        if path.is_dir() {
            assert!(ORDER.contains(&name.as_str()), "{name} is not in ORDER");
        }
    }
}

#[test]
fn every_folder_says_what_it_may_use() {
    for folder in ORDER {
        let doc = fs::read_to_string(src().join(folder).join("mod.rs")).unwrap();
        assert!(doc.starts_with("//!"), "{folder}/mod.rs has no module docs");
        assert!(
            doc.contains(&ORDER.join(" → ")),
            "{folder}/mod.rs does not state the order"
        );
    }
}

#[test]
fn folders_use_only_the_folders_before_them() {
    for (rank, folder) in ORDER.iter().enumerate() {
        let mut files = Vec::new();
        rust_files(&src().join(folder), &mut files);
        for file in files {
            let text = fs::read_to_string(&file).unwrap();
            for head in crate_heads(&text) {
                if let Some(used) = ORDER.iter().position(|f| *f == head) {
                    assert!(
                        used <= rank,
                        "{} uses {head}, which comes after {folder}",
                        file.display()
                    );
                }
            }
        }
    }
}

#[test]
fn the_reference_scanner_sees_groups_and_paths() {
    let text = "use crate::{kernel::maps, pool::{fleet::Fleet, plan}};\n\
                // crate::daemon in a comment\n\
                let x = crate::publish::tables::median_cost(a, b);";
    assert_eq!(crate_heads(text), ["kernel", "pool", "publish"]);
}
