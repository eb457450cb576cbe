//! `docs/participant.md` shows this package file by file: every listing marked
//! `<!-- file: PATH -->` must be PATH's content, and every file of the package but this
//! one must have its listing, so the guide a newcomer copies is the code CI builds.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const GUIDE: &str = include_str!("../../../docs/participant.md");
const MARKER: &str = "<!-- file: ";

/// The listings of the guide, by the path their marker names.
fn listings() -> BTreeMap<String, String> {
    let mut listings = BTreeMap::new();
    let mut rest = GUIDE;
    while let Some(at) = rest.find(MARKER) {
        rest = &rest[at + MARKER.len()..];
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
    let listings = listings();
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
