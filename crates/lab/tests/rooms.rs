//! The lab's rooms are imported in one direction (README.md, "Rooms"): scenario ←
//! world ← report ← runs ← cli. A file names only its own room and the rooms before
//! it in that order; this test reads every source file and fails on a path into a
//! room after its own.

use std::path::{Path, PathBuf};

/// The rooms, in the order they may be imported: each may name those before it.
const ROOMS: [&str; 5] = ["scenario", "world", "report", "runs", "cli"];

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The room a source path (relative to `src/`) stands in.
fn room_of(rel: &Path) -> Option<usize> {
    let first = rel.components().next()?.as_os_str().to_str()?;
    let name = first.strip_suffix(".rs").unwrap_or(first);
    ROOMS.iter().position(|r| *r == name)
}

/// `text` without its comments (line and block), so a doc that names a room after its own
/// is no import.
fn code_of(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix("//") {
            rest = after.find('\n').map_or("", |i| &after[i..]);
        } else if let Some(after) = rest.strip_prefix("/*") {
            rest = after.find("*/").map_or("", |i| &after[i + 2..]);
        } else {
            let c = rest.chars().next().expect("non-empty");
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    out
}

/// The first segment of every `crate::` path in `code`, grouped imports expanded:
/// `use crate::{world::lb, report::{self, text}}` names `world` and `report`.
fn crate_roots(code: &str) -> Vec<String> {
    let ident = |s: &str| -> String {
        s.trim_start()
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        rest = &rest[i + "crate::".len()..];
        let Some(group) = rest.trim_start().strip_prefix('{') else {
            out.push(ident(rest));
            continue;
        };
        // The group's top-level items, up to its closing brace.
        let (mut depth, mut item) = (0usize, String::new());
        for c in group.chars() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => break,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    out.push(ident(&item));
                    item.clear();
                    continue;
                }
                _ => {}
            }
            if depth == 0 {
                item.push(c);
            }
        }
        out.push(ident(&item));
    }
    out.retain(|r| !r.is_empty());
    out
}

#[test]
fn no_room_imports_a_room_after_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut wrong = Vec::new();
    for file in &files {
        let rel = file.strip_prefix(&src).expect("under src");
        let Some(room) = room_of(rel) else {
            continue; // lib.rs: the crate's door and the rooms' list
        };
        let code = code_of(&std::fs::read_to_string(file).expect("read source"));
        let roots = crate_roots(&code);
        for after in &ROOMS[room + 1..] {
            if roots.iter().any(|r| r == after) {
                wrong.push(format!("{} names crate::{after}", rel.display()));
            }
        }
    }
    assert!(files.len() > 20, "found the sources: {}", files.len());
    assert!(
        wrong.is_empty(),
        "imports into a room after its own: {wrong:#?}"
    );
}

#[test]
fn comments_are_not_imports() {
    assert_eq!(
        code_of("a // crate::runs\nb /* crate::cli */ c"),
        "a \nb  c"
    );
}

/// A grouped import names every room in its group, nested groups too; a room's name
/// inside a deeper path (`crate::world::report`) is not that room.
#[test]
fn grouped_imports_are_expanded() {
    assert_eq!(
        crate_roots("use crate::{world::lb, report::{self, text}};\nuse crate::runs::held;"),
        ["world", "report", "runs"]
    );
    assert_eq!(
        crate_roots("use crate::{\n    scenario::{a, b},\n    cli,\n};"),
        ["scenario", "cli"]
    );
    assert_eq!(crate_roots("crate::world::report::x"), ["world"]);
}
