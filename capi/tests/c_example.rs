//! The C example (`capi/examples/transfer.c`), compiled with the system C compiler
//! (`cc -Wall -Wextra -Werror`) against the cdylib, run as two processes over TCP loopback
//! with a pre-shared key: both must exit 0 (the decode process checks every byte and the
//! aux record). A negative control runs it again with the decode's byte check corrupted on
//! purpose, which must make it fail: the check is live.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// `target/<profile>`, where cargo put the cdylib (this test runs from `deps/` below it).
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test's path");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps")
        .to_path_buf()
}

/// Builds the cdylib (a test of this package does not: cargo links only rlibs into
/// tests), with the cargo that runs this test, into the same target directory and profile.
fn build_cdylib(lib: &Path) {
    let target_dir = lib.parent().expect("target/<profile>");
    let profile = match lib.file_name().and_then(|n| n.to_str()) {
        Some("debug") | None => "dev",
        Some(p) => p,
    };
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(&cargo)
        .args(["build", "-p", "kvwire-capi", "--lib", "--profile", profile])
        .arg("--target-dir")
        .arg(target_dir)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .unwrap_or_else(|e| panic!("cannot run `{cargo} build`: {e}"));
    assert!(
        status.success(),
        "`cargo build -p kvwire-capi` failed ({status})"
    );
}

fn compile() -> PathBuf {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = lib_dir();
    build_cdylib(&lib);
    let so = lib.join(if cfg!(target_os = "macos") {
        "libkvwire_capi.dylib"
    } else {
        "libkvwire_capi.so"
    });
    assert!(
        so.exists(),
        "{} is missing after `cargo build -p kvwire-capi`",
        so.display()
    );
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kvwire-c-example");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1"])
        .arg(format!("-I{}", crate_dir.join("include").display()))
        .arg(crate_dir.join("examples/transfer.c"))
        .arg(format!("-L{}", lib.display()))
        .arg("-lkvwire_capi")
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-o")
        .arg(&out)
        .status()
        .unwrap_or_else(|e| panic!("cannot run the C compiler `{cc}`: {e}"));
    assert!(status.success(), "the C example did not compile ({status})");
    out
}

fn wait(mut child: Child, deadline: Instant, who: &str) -> Output {
    loop {
        if child.try_wait().expect("try_wait").is_some() {
            return child.wait_with_output().expect("output");
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!(
                "{who} did not finish in time; stdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Runs decode and prefill; returns their outputs.
fn run(exe: &Path, corrupt_check: bool) -> (Output, Output) {
    let psk = kvwire::config::auth::generate_hex().expect("a key");
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let addr_file = dir.join(format!(
        "kvwire-c-example-{}-{corrupt_check}.addr",
        std::process::id()
    ));
    let _ = std::fs::remove_file(&addr_file);
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut decode = Command::new(exe);
    decode
        .arg("decode")
        .arg(&addr_file)
        .env("KVWIRE_PSK", &psk)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if corrupt_check {
        decode.env("KVWIRE_EXAMPLE_CORRUPT_CHECK", "1");
    }
    let mut decode = decode.spawn().expect("spawn decode");
    let addr = loop {
        if let Ok(a) = std::fs::read_to_string(&addr_file) {
            break a.trim().to_owned();
        }
        if let Some(status) = decode.try_wait().expect("try_wait") {
            let out = decode.wait_with_output().expect("output");
            panic!(
                "decode exited ({status}) before listening:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        assert!(
            Instant::now() < deadline,
            "decode never wrote {}",
            addr_file.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    let prefill = Command::new(exe)
        .arg("prefill")
        .arg(&addr)
        .env("KVWIRE_PSK", &psk)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn prefill");
    let prefill = wait(prefill, deadline, "prefill");
    let decode = wait(decode, deadline, "decode");
    let _ = std::fs::remove_file(&addr_file);
    (decode, prefill)
}

fn show(o: &Output) -> String {
    format!(
        "{}; stdout:\n{}stderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn the_c_example_transfers_between_two_processes_and_checks_every_byte() {
    let exe = compile();
    let (decode, prefill) = run(&exe, false);
    assert!(prefill.status.success(), "prefill: {}", show(&prefill));
    assert!(decode.status.success(), "decode: {}", show(&decode));
    let said = String::from_utf8_lossy(&decode.stdout);
    assert!(
        said.contains("verified 7 pages x 2 buffers (57344 bytes, every one checked)"),
        "{said}"
    );

    // Negative control: the same run with one expected byte wrong must fail the decode.
    let (decode, prefill) = run(&exe, true);
    assert!(prefill.status.success(), "prefill: {}", show(&prefill));
    assert!(
        !decode.status.success(),
        "the corrupted byte check passed: {}",
        show(&decode)
    );
    let err = String::from_utf8_lossy(&decode.stderr);
    assert!(
        err.contains("buffer 1 page 40 byte 100") && err.contains("1 bytes differ"),
        "{err}"
    );
}
