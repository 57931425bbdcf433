//! The `kvwire` command-line tool. The benchmark (`kvwire bench`) and `doctor` arrive with
//! the CLI work; until then this binary reports its version and what it can do.

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("--version") | Some("version") => println!("kvwire {}", env!("CARGO_PKG_VERSION")),
        _ => {
            eprintln!(
                "kvwire {}: the `bench`, `doctor` and `check-config` commands are not built yet.\n\
                 Run the test suite with `cargo test --workspace`, and the integrity demo with\n\
                 `cargo run --example stale_page_leak`.",
                env!("CARGO_PKG_VERSION")
            );
            std::process::exit(2);
        }
    }
}
