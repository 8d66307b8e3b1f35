//! ARCHITECTURE.md's table of modules is held to the code: every top-level module of
//! `src/` has a row, the rows run from the bottom up (a module's "may use" names only
//! rows above it), and what a module's code reaches through `crate::` paths is within
//! what its row says it may use. The dependencies are read as the house's cycle check
//! (`shared/tools/module_cycles.py`) reads them: `crate::NAME` paths and `use crate::{..}`
//! groups, unit-test modules left out.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// The top-level modules of `src/`: `src/NAME.rs` and `src/NAME/`.
fn modules(src: &Path) -> BTreeSet<String> {
    fs::read_dir(src)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter_map(|path| {
            let name = path.file_name()?.to_str()?.to_owned();
            if path.is_dir() {
                Some(name)
            } else {
                let stem = name.strip_suffix(".rs")?;
                (stem != "lib" && stem != "main").then(|| stem.to_owned())
            }
        })
        .collect()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            out.push(path);
        }
    }
}

fn is_ident_start(byte: u8) -> bool {
    byte.is_ascii_lowercase() || byte == b'_'
}

fn is_ident(byte: u8) -> bool {
    is_ident_start(byte) || byte.is_ascii_digit()
}

/// The start of `text` made of bytes `ident` takes (an identifier, read as ASCII).
fn leading(text: &str, ident: impl Fn(u8) -> bool) -> &str {
    let end = text.bytes().take_while(|&b| ident(b)).count();
    &text[..end]
}

/// The lowercase identifiers that start a path somewhere in `text` after `prefix`.
fn names_after(text: &str, prefix: &str) -> BTreeSet<String> {
    let bytes = text.as_bytes();
    let mut names = BTreeSet::new();
    for (at, _) in text.match_indices(prefix) {
        // `crate::` as a whole word, not the end of `mycrate::`.
        if at > 0 && is_ident(bytes[at - 1]) {
            continue;
        }
        let start = at + prefix.len();
        let end = start + bytes[start..].iter().take_while(|&&b| is_ident(b)).count();
        if end > start && is_ident_start(bytes[start]) {
            names.insert(text[start..end].to_owned());
        }
    }
    names
}

/// `text` up to its unit-test module: unit tests may reach anywhere.
fn without_unit_tests(text: &str) -> &str {
    text.match_indices("#[cfg(test)]")
        .find(|(at, attribute)| {
            text[at + attribute.len()..]
                .trim_start()
                .starts_with("mod tests")
        })
        .map_or(text, |(at, _)| &text[..at])
}

/// `text` without its comments (doc comments included): a doc link through the root
/// (`[RateLimitLayer](crate::RateLimitLayer)`) names where to read on, which is no use of
/// the module, and the house's cycle check reads no re-export either.
fn code_only(text: &str) -> String {
    text.lines()
        .map(|line| {
            if line.trim_start().starts_with("//") {
                ""
            } else {
                line.split_once(" // ").map_or(line, |(code, _)| code)
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The crate root's re-exports: each name `lib.rs` re-exports (`pub use module::...::Name;`
/// or a `{..}` group), with the top-level module it comes from. `crate::Decision` reaches
/// `decision` as surely as `crate::decision::Decision` does.
fn reexports(lib: &str) -> BTreeMap<String, String> {
    let mut names = BTreeMap::new();
    for statement in lib.split(';') {
        // Attributes and comments may stand before it (`#[cfg(feature = "redis")]`).
        let statement = statement
            .lines()
            .map(str::trim)
            .filter(|line| !line.is_empty() && !line.starts_with("//") && !line.starts_with("#["))
            .collect::<Vec<_>>()
            .join(" ");
        let Some(path) = statement.strip_prefix("pub use ") else {
            continue;
        };
        let module = leading(path, is_ident).to_owned();
        // A group's leaves, nested groups flattened (`a::{B, c::{D, E}}`).
        let leaves = match path.find('{') {
            Some(open) => path[open + 1..].replace(['{', '}'], ""),
            None => path.rsplit("::").next().unwrap_or_default().to_owned(),
        };
        for leaf in leaves.split(',') {
            let leaf = leaf.trim().rsplit("::").next().unwrap_or_default().trim();
            if !leaf.is_empty() {
                names.insert(leaf.to_owned(), module.clone());
            }
        }
    }
    names
}

/// The identifiers of any case that start a path somewhere in `text` after `crate::`,
/// read through the root's re-exports to the module each comes from.
fn reexports_reached(text: &str, reexports: &BTreeMap<String, String>) -> BTreeSet<String> {
    let bytes = text.as_bytes();
    let any_ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    let mut names = BTreeSet::new();
    let mut note = |name: &str| {
        if let Some(module) = reexports.get(name) {
            names.insert(module.clone());
        }
    };
    for (at, _) in text.match_indices("crate::") {
        if at > 0 && is_ident(bytes[at - 1]) {
            continue;
        }
        let start = at + "crate::".len();
        if bytes.get(start) == Some(&b'{') {
            let end = text[start..]
                .find('}')
                .map_or(text.len(), |end| start + end);
            for item in text[start + 1..end].split(',') {
                note(leading(item.trim(), any_ident));
            }
        } else {
            note(leading(&text[start..], any_ident));
        }
    }
    names
}

/// The modules `text` reaches: `crate::NAME` and the first name of each path in a
/// `use crate::{...};` group.
fn reached(text: &str) -> BTreeSet<String> {
    let text = without_unit_tests(text);
    let mut names = names_after(text, "crate::");
    let mut rest = text;
    while let Some(at) = rest.find("use crate::{") {
        let group = &rest[at + "use crate::{".len()..];
        let end = group.find("};").unwrap_or(group.len());
        for item in group[..end].split([',', '{']) {
            let item = item.trim();
            let head = leading(item, is_ident);
            // `name::...` or a bare `name` (a module itself) names a module.
            let rest_of_item = item[head.len()..].trim_start();
            if !head.is_empty() && (rest_of_item.is_empty() || rest_of_item.starts_with("::")) {
                names.insert(head.to_owned());
            }
        }
        rest = &group[end..];
    }
    names
}

/// One row of the table: a module, the modules it may use, and whether its row says
/// "everything above" (then it names no module, and its uses are not checked for being
/// made).
type Row = (String, BTreeSet<String>, bool);

/// The table's rows in order.
fn table(architecture: &str) -> Vec<Row> {
    let section = architecture
        .split("## Modules and what each owns")
        .nth(1)
        .expect("ARCHITECTURE.md has a section 'Modules and what each owns'");
    let section = section.split("\n## ").next().unwrap();
    let mut rows: Vec<Row> = Vec::new();
    for line in section.lines().filter(|line| line.starts_with("| `")) {
        let cells: Vec<&str> = line.split('|').collect();
        assert!(cells.len() >= 5, "a row of three cells: {line}");
        let module = cells[1].trim().trim_matches('`').trim_end_matches('/');
        let may_use = cells[cells.len() - 2];
        let everything = may_use.contains("everything above");
        let allowed: BTreeSet<String> = if everything {
            rows.iter().map(|(name, _, _)| name.clone()).collect()
        } else {
            may_use
                .split('`')
                .skip(1)
                .step_by(2)
                .map(|name| name.trim_end_matches('/').to_owned())
                .collect()
        };
        rows.push((module.to_owned(), allowed, everything));
    }
    rows
}

#[test]
fn the_module_table_matches_the_code() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let src = root.join("src");
    let modules = modules(&src);
    let architecture = fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    let rows = table(&architecture);

    let listed: BTreeSet<String> = rows.iter().map(|(name, _, _)| name.clone()).collect();
    assert_eq!(
        listed, modules,
        "ARCHITECTURE.md's table lists every top-level module of src/ and no other"
    );
    assert_eq!(listed.len(), rows.len(), "each module has one row");

    // Bottom up: a row names only modules of the rows above it.
    for (at, (module, allowed, _)) in rows.iter().enumerate() {
        let above: BTreeSet<&String> = rows[..at].iter().map(|(name, _, _)| name).collect();
        for name in allowed {
            assert!(
                above.contains(name),
                "the row of `{module}` may use `{name}`, which is not a row above it"
            );
        }
    }

    // What each module's code reaches is within its row.
    let reexports = reexports(&fs::read_to_string(src.join("lib.rs")).unwrap());
    let mut reaches: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    for file in files {
        let relative = file.strip_prefix(&src).unwrap();
        let first = relative.components().next().unwrap().as_os_str();
        let first = first.to_str().unwrap();
        let module = first.strip_suffix(".rs").unwrap_or(first);
        if !modules.contains(module) {
            continue; // lib.rs
        }
        let text = fs::read_to_string(&file).unwrap();
        let text = without_unit_tests(&text);
        let entry = reaches.entry(module.to_owned()).or_default();
        entry.extend(
            reached(text)
                .into_iter()
                .chain(reexports_reached(&code_only(text), &reexports))
                .filter(|name| name != module && modules.contains(name)),
        );
    }
    let mut wrong = Vec::new();
    for (module, allowed, _) in &rows {
        for name in reaches.get(module).into_iter().flatten() {
            if !allowed.contains(name) {
                wrong.push(format!("`{module}` uses `{name}`"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "ARCHITECTURE.md's table does not allow what the code does: {}",
        wrong.join(", ")
    );

    // And a row names no module its code does not use (a row of "everything above" names
    // none): a reader takes the table for what the code does.
    let mut stale = Vec::new();
    for (module, allowed, everything) in &rows {
        if *everything {
            continue;
        }
        let used = reaches.get(module).cloned().unwrap_or_default();
        for name in allowed.difference(&used) {
            stale.push(format!("`{module}` may use `{name}`"));
        }
    }
    assert!(
        stale.is_empty(),
        "ARCHITECTURE.md's table names uses the code does not make: {}",
        stale.join(", ")
    );
}

#[test]
fn the_reader_finds_what_the_cycle_check_finds() {
    // The reader above, on the forms the code uses.
    let text = "use crate::key::Key;\nuse crate::{\n    policy::PolicySet,\n    store::{Store, StoreError},\n    decision,\n};\nlet x = crate::clock::now(); mycrate::body::x;\n#[cfg(test)]\nmod tests { use crate::layer::X; }";
    let found: Vec<String> = reached(text).into_iter().collect();
    assert_eq!(found, ["clock", "decision", "key", "policy", "store"]);
}

#[test]
fn code_only_leaves_comments_out() {
    let text = "/// [`Layer`](crate::RateLimitLayer)\n//! crate::Decision\nlet a = crate::Outcome::Allowed; // crate::RateLimit\nlet url = \"redis://x\"; let b = crate::Key::new(url);";
    let code = code_only(text);
    assert!(
        !code.contains("RateLimitLayer") && !code.contains("Decision"),
        "{code}"
    );
    assert!(
        !code.contains("crate::RateLimit;") && !code.contains("// crate::RateLimit"),
        "{code}"
    );
    assert!(
        code.contains("crate::Outcome::Allowed") && code.contains("crate::Key::new(url)"),
        "{code}"
    );
}

#[test]
fn the_reader_follows_the_roots_reexports() {
    let lib = "#[cfg(feature = \"redis\")]\npub use store::RedisStore;\n/// Docs.\npub use key::{Key, ip::{ClientIp, InvalidProxy}};\npub use decision::{Decision, Outcome};\npub use layer::{DEFAULT_STORE_TIMEOUT, RateLimitLayer};\npub use respond::headers::HeaderStyle;\npub use respond::problem::{\n    QUOTA_EXCEEDED, Rejection,\n};\npub use service::RateLimit;";
    let reexports = reexports(lib);
    assert_eq!(reexports["Decision"], "decision");
    assert_eq!(reexports["HeaderStyle"], "respond");
    assert_eq!(reexports["Rejection"], "respond");
    assert_eq!(reexports["RedisStore"], "store");
    assert_eq!(reexports["ClientIp"], "key");
    assert_eq!(reexports["InvalidProxy"], "key");
    assert_eq!(reexports["Key"], "key");
    let text = "let t = crate::DEFAULT_STORE_TIMEOUT;\nfn f(d: crate::Decision) {}\nuse crate::{HeaderStyle, key::Key};\n/// [`x`](crate::RateLimit::call)\nmycrate::Outcome";
    let found: Vec<String> = reexports_reached(text, &reexports).into_iter().collect();
    assert_eq!(found, ["decision", "layer", "respond", "service"]);
}

/// ARCHITECTURE.md's rule, as written: each file of `lua/` is the twin of one file of
/// `src/algorithm/` (the same name), and each algorithm file has its twin there. The
/// store's side of the scripts (the prelude, the decision loop, the adjustment, what each
/// call starts with), whose twins are in `src/store/` (and the prelude's bucket
/// arithmetic, in `src/algorithm/token_bucket.rs`), lives in `lua/store/`.
#[test]
fn each_lua_file_is_the_twin_of_one_algorithm_file() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let stems = |dir: &str, extension: &str| -> BTreeSet<String> {
        fs::read_dir(root.join(dir))
            .unwrap()
            .filter_map(|entry| {
                let path = entry.unwrap().path();
                let name = path.file_name()?.to_str()?.to_owned();
                (path.is_file())
                    .then(|| name.strip_suffix(extension).map(str::to_owned))
                    .flatten()
            })
            .collect()
    };
    let scripts = stems("lua", ".lua");
    let mut algorithms = stems("src/algorithm", ".rs");
    algorithms.remove("mod");
    assert_eq!(scripts, algorithms, "lua/ and src/algorithm/ differ");
    let architecture = fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    for stem in &scripts {
        let row = architecture.lines().any(|line| {
            line.trim_start().starts_with(&format!("| `{stem}.lua`"))
                && line.contains(&format!("| `{stem}.rs`"))
        });
        assert!(
            row,
            "ARCHITECTURE.md's table of twins has no row for {stem}"
        );
    }
}
