//! The library's modules import only down their layers. The layers are the table under
//! "Layers" in `docs/architecture.md`, read from there, so the document and the code
//! cannot drift apart: a module that imports a module of a higher layer fails here
//! unless it is one of the few exceptions the document lists, each with its reason; a
//! new module fails until the table places it; an exception that no longer happens
//! fails too, so the list only shrinks.
//!
//! An import is any `crate::<module>` path in a file's non-test code, `use` or inline
//! (doc links and `#[cfg(doc)]` imports are documentation, not dependencies), resolved to
//! the top-level module it names; names the crate root re-exports resolve to the module
//! that defines them.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// The layers, lowest first, as `docs/architecture.md` tables them, and the exceptions:
/// (importing module, imported module) pairs allowed to point up.
struct Layers {
    rank: BTreeMap<String, usize>,
    exceptions: BTreeSet<(String, String)>,
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The backtick-quoted words of a markdown table cell.
fn quoted(cell: &str) -> Vec<String> {
    cell.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

fn layers() -> Layers {
    let doc =
        fs::read_to_string(root().join("docs/architecture.md")).expect("docs/architecture.md");
    let section = doc
        .split("\n## Layers\n")
        .nth(1)
        .expect("docs/architecture.md has a section \"## Layers\"");
    let section = section.split("\n## ").next().unwrap_or(section);
    let mut rank = BTreeMap::new();
    let mut exceptions = BTreeSet::new();
    for row in section.lines().filter(|line| line.starts_with('|')) {
        let cells: Vec<&str> = row.trim_matches('|').split('|').map(str::trim).collect();
        match cells.as_slice() {
            // | layer | name | modules | what it holds |
            [layer, _, modules, _] if layer.parse::<usize>().is_ok() => {
                let layer: usize = layer.parse().expect("a layer number");
                for module in quoted(modules) {
                    assert!(
                        rank.insert(module.clone(), layer).is_none(),
                        "module {module} is in two layers of docs/architecture.md"
                    );
                }
            }
            // | `from` → `to` | why |
            [pair, _] if pair.contains('→') => {
                let names = quoted(pair);
                assert_eq!(names.len(), 2, "an exception names two modules: {row}");
                exceptions.insert((names[0].clone(), names[1].clone()));
            }
            _ => {}
        }
    }
    assert!(rank.len() > 10, "no layer table found under \"## Layers\"");
    Layers { rank, exceptions }
}

/// Every `.rs` file under `dir`.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).expect("read src") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            out.push(path);
        }
    }
}

/// The file's code without its unit tests, comments and `#[cfg(doc)]` imports.
fn code(text: &str) -> String {
    let text = text.split("#[cfg(test)]\nmod tests").next().unwrap_or(text);
    let mut out = String::new();
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("#[cfg(doc)]") {
            // Skip the import it gates, up to its semicolon.
            for next in lines.by_ref() {
                if next.contains(';') {
                    break;
                }
            }
            continue;
        }
        let without_comment = match line.find("//") {
            Some(at) => &line[..at],
            None => line,
        };
        out.push_str(without_comment);
        out.push('\n');
    }
    out
}

fn ident_at(text: &str) -> &str {
    let end = text
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(text.len());
    &text[..end]
}

/// The first segment of every path in a `{…}` group that starts `text` (just after
/// `crate::`): `{a, b::{c, d}, e::f}` gives `a`, `b`, `e`.
fn group_heads(text: &str) -> Vec<&str> {
    let mut heads = Vec::new();
    let mut depth = 0;
    let mut start_of_item = true;
    for (at, c) in text.char_indices() {
        match c {
            '{' => {
                depth += 1;
                start_of_item = depth == 1;
            }
            '}' => {
                depth -= 1;
                if depth == 0 {
                    break;
                }
            }
            ',' if depth == 1 => start_of_item = true,
            c if start_of_item && depth == 1 && !c.is_whitespace() => {
                heads.push(ident_at(&text[at..]));
                start_of_item = false;
            }
            _ => {}
        }
    }
    heads
}

/// The names `crate::` paths start with in `code`.
fn crate_heads(code: &str) -> BTreeSet<String> {
    let mut heads = BTreeSet::new();
    for (at, _) in code.match_indices("crate::") {
        let rest = &code[at + "crate::".len()..];
        if rest.starts_with('{') {
            heads.extend(group_heads(rest).into_iter().map(str::to_owned));
        } else {
            heads.insert(ident_at(rest).to_owned());
        }
    }
    heads.remove("");
    heads
}

/// The modules the crate root re-exports names from: `pub use store::PostgresStore;`
/// makes `crate::PostgresStore` an import of `store`.
fn root_reexports(lib: &str) -> BTreeMap<String, String> {
    let mut names = BTreeMap::new();
    for statement in lib.split(';') {
        let Some(at) = statement.find("pub use ") else {
            continue;
        };
        let path = &statement[at + "pub use ".len()..];
        let module = ident_at(path);
        let items = path[module.len()..].trim_start_matches("::");
        for item in items.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
            if !item.is_empty() {
                names.insert(item.to_owned(), module.to_owned());
            }
        }
    }
    names
}

/// Each top-level module's file imports: (file, importing module) → imported modules.
fn imports() -> BTreeMap<(String, String), BTreeSet<String>> {
    let src = root().join("src");
    let lib = fs::read_to_string(src.join("lib.rs")).expect("src/lib.rs");
    let reexports = root_reexports(&lib);
    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut imports = BTreeMap::new();
    for file in files {
        let relative = file.strip_prefix(&src).expect("under src");
        if relative == Path::new("lib.rs") {
            continue;
        }
        let module = relative
            .components()
            .next()
            .and_then(|first| first.as_os_str().to_str())
            .expect("a path")
            .trim_end_matches(".rs")
            .to_owned();
        let text = fs::read_to_string(&file).expect("read a source file");
        let imported: BTreeSet<String> = crate_heads(&code(&text))
            .into_iter()
            .map(|head| reexports.get(&head).cloned().unwrap_or(head))
            .filter(|head| *head != module && head.starts_with(|c: char| c.is_ascii_lowercase()))
            .collect();
        imports.insert((relative.display().to_string(), module), imported);
    }
    imports
}

#[test]
fn every_module_imports_only_down_its_layers_but_for_the_listed_exceptions() {
    let layers = layers();
    let mut up = BTreeSet::new();
    let mut unplaced = BTreeSet::new();
    for ((file, module), imported) in imports() {
        let Some(&from) = layers.rank.get(&module) else {
            unplaced.insert(module);
            continue;
        };
        for target in imported {
            match layers.rank.get(&target) {
                Some(&to) if to > from => {
                    up.insert((module.clone(), target, file.clone()));
                }
                Some(_) => {}
                None => {
                    unplaced.insert(target);
                }
            }
        }
    }
    assert!(
        unplaced.is_empty(),
        "modules no layer of docs/architecture.md places: {unplaced:?}"
    );
    let unlisted: Vec<_> = up
        .iter()
        .filter(|(from, to, _)| !layers.exceptions.contains(&(from.clone(), to.clone())))
        .collect();
    assert!(
        unlisted.is_empty(),
        "imports that point up the layers of docs/architecture.md (module, imported, file): {unlisted:#?}"
    );
    let happening: BTreeSet<(String, String)> = up
        .iter()
        .map(|(from, to, _)| (from.clone(), to.clone()))
        .collect();
    let stale: Vec<_> = layers.exceptions.difference(&happening).collect();
    assert!(
        stale.is_empty(),
        "exceptions docs/architecture.md lists that no import makes any more (drop them): {stale:?}"
    );
    println!("up-imports (module, imported, file): {up:#?}");
}

#[test]
fn the_modules_form_no_circle_but_through_the_listed_exceptions() {
    let layers = layers();
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for ((_, module), imported) in imports() {
        let edges = graph.entry(module.clone()).or_default();
        for target in imported {
            if !layers
                .exceptions
                .contains(&(module.clone(), target.clone()))
            {
                edges.insert(target);
            }
        }
    }
    // Kahn's algorithm: what is left once every module without imports left is taken
    // away lies on a circle.
    let mut left = graph.clone();
    loop {
        let leaves: Vec<String> = left
            .iter()
            .filter(|(_, targets)| targets.iter().all(|target| !left.contains_key(target)))
            .map(|(module, _)| module.clone())
            .collect();
        if leaves.is_empty() {
            break;
        }
        for leaf in leaves {
            left.remove(&leaf);
        }
    }
    assert!(
        left.is_empty(),
        "modules that import each other in a circle: {:?}",
        left.keys().collect::<Vec<_>>()
    );
}

#[test]
fn the_import_reader_finds_groups_inline_paths_and_skips_comments_and_tests() {
    let text = "use crate::a::X;\nuse crate::{b, c::{D, e::F}};\nfn f() { crate::g::h(); }\n\
                // crate::commented\n#[cfg(doc)]\nuse crate::{\n    doc_only,\n};\n\
                #[cfg(test)]\nmod tests {\n    use crate::tested;\n}\n";
    let heads = crate_heads(&code(text));
    assert_eq!(
        heads,
        ["a", "b", "c", "g"]
            .map(str::to_owned)
            .into_iter()
            .collect()
    );
    let lib = "pub use store::{InboxStore, PostgresStore};\npub use month::Month;";
    let reexports = root_reexports(lib);
    assert_eq!(reexports["PostgresStore"], "store");
    assert_eq!(reexports["Month"], "month");
}
