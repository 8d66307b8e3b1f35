//! What docs.rs shows of the crate. docs.rs builds with the default features unless the
//! manifest says otherwise, so without its `[package.metadata.docs.rs]` table the Redis
//! store, the GraphQL coster, the metrics and the tonic support would be missing from the
//! published docs, and nothing would say which feature an item needs.

use std::collections::BTreeSet;

fn manifest() -> toml::Table {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"))
        .expect("Cargo.toml");
    toml::from_str(&text).expect("Cargo.toml parses")
}

/// The features a user may turn on: all but `default` and the private ones (`__` in
/// front, such as the test clock, which no published build should document as usable).
fn public_features(manifest: &toml::Table) -> BTreeSet<String> {
    manifest["features"]
        .as_table()
        .expect("a [features] table")
        .keys()
        .filter(|name| *name != "default" && !name.starts_with("__"))
        .cloned()
        .collect()
}

fn docs_rs(manifest: &toml::Table) -> &toml::Table {
    manifest["package"]
        .get("metadata")
        .and_then(|metadata| metadata.get("docs")?.get("rs"))
        .and_then(toml::Value::as_table)
        .expect("a [package.metadata.docs.rs] table")
}

#[test]
fn docs_rs_documents_every_public_feature_and_no_private_one() {
    let manifest = manifest();
    let table = docs_rs(&manifest);
    assert!(
        table.get("all-features").is_none(),
        "all-features would document the private test clock as part of the API"
    );
    let listed: BTreeSet<String> = table["features"]
        .as_array()
        .expect("docs.rs features: a list")
        .iter()
        .map(|feature| feature.as_str().expect("a feature name").to_owned())
        .collect();
    assert_eq!(listed, public_features(&manifest));
}

/// Each feature-gated item says which feature it needs: docs.rs passes `--cfg docsrs`
/// and the crate then turns on rustdoc's `doc_cfg`, which labels the item with its cfg.
#[test]
fn docs_rs_labels_items_with_the_feature_they_need() {
    let manifest = manifest();
    let args: Vec<&str> = docs_rs(&manifest)["rustdoc-args"]
        .as_array()
        .expect("rustdoc-args: a list")
        .iter()
        .map(|arg| arg.as_str().expect("an argument"))
        .collect();
    assert!(
        args.windows(2).any(|pair| pair == ["--cfg", "docsrs"]),
        "{args:?}"
    );
    let lib = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/src/lib.rs"))
        .expect("src/lib.rs");
    assert!(
        lib.lines()
            .any(|line| line.trim() == "#![cfg_attr(docsrs, feature(doc_cfg))]"),
        "src/lib.rs does not turn on doc_cfg under docsrs"
    );
}

/// The crate's front page names every feature a user may turn on.
#[test]
fn the_crate_docs_name_every_public_feature() {
    let manifest = manifest();
    let lib = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/src/lib.rs"))
        .expect("src/lib.rs");
    let docs: String = lib
        .lines()
        .filter_map(|line| line.strip_prefix("//!"))
        .collect::<Vec<_>>()
        .join("\n");
    for feature in public_features(&manifest) {
        assert!(
            docs.contains(&format!("`{feature}`")),
            "the crate docs do not name the feature `{feature}`"
        );
    }
}
