//! The docs show code that CI builds. `docs/participant.md` shows this package file by
//! file: every listing marked `<!-- file: PATH -->` must be PATH's content, and every
//! file of the package but this one must have its listing. The README's Rust listings
//! are marked `<!-- excerpt: PATH -->` and must be a run of PATH's lines (less their
//! indentation), PATH an example that the README's test command builds.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const GUIDE: &str = include_str!("../../../docs/participant.md");
const README: &str = include_str!("../../../README.md");

/// The listings of `text` marked with `marker`, by the path their marker names.
fn listings(text: &str, marker: &str) -> BTreeMap<String, String> {
    let mut listings = BTreeMap::new();
    let mut rest = text;
    while let Some(at) = rest.find(marker) {
        rest = &rest[at + marker.len()..];
        let (path, after) = rest.split_once(" -->\n").expect("a marker ends with -->");
        let after = after
            .strip_prefix("```")
            .expect("a listing follows its marker");
        let (_language, body) = after.split_once('\n').expect("the fence's line");
        let end = body.find("\n```").expect("the listing's closing fence");
        let previous = listings.insert(path.to_owned(), format!("{}\n", &body[..end]));
        assert!(previous.is_none(), "{path} is listed twice");
        rest = &body[end..];
    }
    listings
}

/// The package's files (without `target/`), relative to it.
fn files(root: &Path, dir: &Path, found: &mut Vec<String>) {
    for entry in std::fs::read_dir(dir).expect("read the package") {
        let path: PathBuf = entry.expect("a directory entry").path();
        if path.is_dir() {
            if path.file_name().is_some_and(|name| name != "target") {
                files(root, &path, found);
            }
        } else {
            let relative = path.strip_prefix(root).expect("inside the package");
            found.push(relative.to_string_lossy().into_owned());
        }
    }
}

#[test]
fn every_file_of_the_package_is_in_the_guide_as_it_is() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let listings = listings(GUIDE, "<!-- file: ");
    let mut found = Vec::new();
    files(root, root, &mut found);
    found.retain(|path| path != "tests/guide.rs");
    found.sort();
    let listed: Vec<String> = listings.keys().cloned().collect();
    assert_eq!(
        listed, found,
        "the guide's listings and the package's files differ"
    );
    for (path, listing) in &listings {
        let file = std::fs::read_to_string(root.join(path)).expect("a listed file");
        assert!(
            *listing == file,
            "docs/participant.md's listing of {path} differs from examples/ledger/{path}: \
             copy the file into the guide"
        );
    }
}

#[test]
fn every_rust_listing_of_the_readme_is_an_excerpt_of_an_example() {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let excerpts = listings(README, "<!-- excerpt: ");
    let fences = README.matches("```rust").count();
    assert_eq!(
        excerpts.len(),
        fences,
        "every Rust listing of the README is marked as an excerpt"
    );
    for (path, excerpt) in &excerpts {
        let file = std::fs::read_to_string(workspace.join(path)).expect("an excerpted file");
        let lines: Vec<&str> = file.lines().map(str::trim_start).collect();
        let wanted: Vec<&str> = excerpt.lines().map(str::trim_start).collect();
        assert!(
            lines
                .windows(wanted.len())
                .any(|run| run == wanted.as_slice()),
            "the README's excerpt of {path} is not in it: copy the lines again"
        );
    }
}
