//! The sans-IO crate stays sans-IO: no async runtime, no libc, no RDMA bindings among its
//! normal dependencies (only an allow-listed set), and no `unsafe` in its source.

use std::path::{Path, PathBuf};
use std::process::Command;

fn proto_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn no_io_dependencies() {
    let workspace = proto_dir().join("..");
    let out = Command::new(env!("CARGO"))
        .args([
            "tree",
            "-p",
            "kvwire-proto",
            "-e",
            "normal",
            "--prefix",
            "none",
        ])
        .current_dir(&workspace)
        .output()
        .expect("running cargo tree");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "cargo tree failed ({}):\n{}\n{stdout}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.lines().any(|l| l.starts_with("kvwire-proto ")),
        "unexpected cargo tree output:\n{stdout}"
    );
    let forbidden = ["tokio", "libc", "sideway", "rdma"];
    let bad: Vec<&str> = stdout
        .lines()
        .map(str::trim)
        .filter(|l| forbidden.iter().any(|f| l.starts_with(f)))
        .collect();
    assert!(
        bad.is_empty(),
        "kvwire-proto depends on {bad:?}; its dependency tree:\n{stdout}"
    );
    // An explicit allow-list: a new dependency of the protocol crate is a decision, made
    // here. crc32fast (frame CRC); hmac + sha2 and the RustCrypto crates under them
    // (authenticated peers, SPEC.md §3.11) — pure Rust, no I/O; cpufeatures only reads CPUID;
    // foldhash (the maps keyed by transfer id, `wire::TransferIdMap`; no dependencies,
    // seeded from addresses and the clock).
    let allowed = [
        "kvwire-proto",
        "crc32fast",
        "cfg-if",
        "foldhash",
        "hmac",
        "sha2",
        "digest",
        "block-buffer",
        "crypto-common",
        "generic-array",
        "typenum",
        "subtle",
        "cpufeatures",
        "version_check",
    ];
    let unexpected: Vec<&str> = stdout
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .filter(|l| {
            let name = l.split_whitespace().next().unwrap_or("");
            !allowed.contains(&name)
        })
        .collect();
    assert!(
        unexpected.is_empty(),
        "kvwire-proto depends on {unexpected:?}, which the allow-list does not name; its dependency tree:\n{stdout}"
    );
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Whether `line` (comments removed) uses the `unsafe` keyword as a whole word.
fn uses_unsafe(line: &str) -> bool {
    let code = line.split("//").next().unwrap_or("");
    let is_ident = |c: char| c.is_alphanumeric() || c == '_';
    code.match_indices("unsafe").any(|(i, w)| {
        let before = code[..i].chars().next_back();
        let after = code[i + w.len()..].chars().next();
        !before.is_some_and(is_ident) && !after.is_some_and(is_ident)
    })
}

#[test]
fn keyword_scanner_finds_unsafe() {
    assert!(uses_unsafe("    unsafe { x() }"));
    assert!(uses_unsafe("unsafe impl Send for X {}"));
    assert!(uses_unsafe("pub unsafe fn f() {}"));
    assert!(!uses_unsafe("#![forbid(unsafe_code)]"));
    assert!(!uses_unsafe("// unsafe in a comment"));
    assert!(!uses_unsafe("let not_unsafe = 1;"));
}

#[test]
fn no_unsafe_code() {
    let src = proto_dir().join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    assert!(files.len() > 1, "no sources found under {}", src.display());
    let mut hits = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        for (n, line) in text.lines().enumerate() {
            if uses_unsafe(line) {
                hits.push(format!("{}:{}: {}", f.display(), n + 1, line.trim()));
            }
        }
    }
    assert!(
        hits.is_empty(),
        "`unsafe` in kvwire-proto:\n{}",
        hits.join("\n")
    );

    let lib = std::fs::read_to_string(src.join("lib.rs")).unwrap();
    assert!(
        lib.lines().any(|l| l.trim() == "#![forbid(unsafe_code)]"),
        "proto/src/lib.rs must carry #![forbid(unsafe_code)]"
    );
}
