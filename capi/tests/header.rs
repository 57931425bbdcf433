//! The checked-in header is what cbindgen (the pinned dev-dependency) generates from
//! `src/lib.rs` now: a change of the ABI without a regenerated header fails here.

#[test]
fn the_checked_in_header_matches_the_abi() {
    let dir = env!("CARGO_MANIFEST_DIR");
    let config =
        cbindgen::Config::from_file(format!("{dir}/cbindgen.toml")).expect("capi/cbindgen.toml");
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(format!("{dir}/src/lib.rs"))
        .generate()
        .expect("cbindgen could not generate the header from capi/src/lib.rs");
    let mut generated = Vec::new();
    bindings.write(&mut generated);
    let path = format!("{dir}/include/kvwire.h");
    let current = std::fs::read(&path).unwrap_or_default();
    if std::env::var("KVWIRE_REGENERATE_HEADER").is_ok_and(|v| v == "1") && current != generated {
        // The run that regenerates fails: the new header is reviewed and committed, and the
        // next run compares it like any other.
        std::fs::write(&path, &generated).expect("write capi/include/kvwire.h");
        panic!("KVWIRE_REGENERATE_HEADER=1: regenerated {path}; review it, commit it, and run again without the variable");
    }
    if current != generated {
        let (cur, new) = (
            String::from_utf8_lossy(&current),
            String::from_utf8_lossy(&generated),
        );
        let first = cur
            .lines()
            .zip(new.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(cur.lines().count().min(new.lines().count()));
        panic!(
            "capi/include/kvwire.h is out of date with capi/src/lib.rs (first difference at \
             line {}: checked in {:?}, generated {:?}).\nRegenerate it and commit the result:\n  \
             KVWIRE_REGENERATE_HEADER=1 cargo test -p kvwire-capi --test header",
            first + 1,
            cur.lines().nth(first).unwrap_or("<end of file>"),
            new.lines().nth(first).unwrap_or("<end of file>"),
        );
    }
}
