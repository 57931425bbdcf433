//! Fast checks of the assurance tooling itself (the full model check is
//! `scripts/model-check.sh`, in release mode).

use kvwire_model::explore::explore;
use kvwire_model::single::{run_decode, run_receiver, run_sender};
use kvwire_model::world::{Bounds, World};

/// The fault-free model with two transfers explores completely and passes.
#[test]
fn the_clean_model_passes_and_reports_its_size() {
    let bounds = Bounds {
        drops: 0,
        duplicates: 0,
        lost_writes: 0,
        aborts: 0,
        peer_losses: 0,
        rereservations: 0,
        early_timeouts: 0,
        ..Bounds::small()
    };
    let r = explore(World::new(&bounds), 200).expect("no counterexample");
    println!("{r:?}");
    assert!(r.states > 100, "{r:?}");
    assert!(r.quiescent > 0, "{r:?}");
}

/// The checker is not vacuous: a depth bound below the shortest complete run is reported
/// as non-termination.
#[test]
fn a_run_longer_than_the_bound_is_a_counterexample() {
    let c = explore(World::new(&Bounds::small()), 5).expect_err("must not pass");
    assert!(
        c.violation.0.contains("does not terminate"),
        "{}",
        c.violation
    );
    assert_eq!(c.trace.len(), 5);
}

/// A tiny deterministic generator for the smoke runs below.
fn xorshift(seed: &mut u64) -> u64 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    *seed
}

fn random_inputs(n: usize, len: usize) -> Vec<Vec<u8>> {
    let mut seed = 0x9e37_79b9_7f4a_7c15;
    (0..n)
        .map(|_| {
            let l = (xorshift(&mut seed) as usize) % len;
            (0..l).map(|_| xorshift(&mut seed) as u8).collect()
        })
        .collect()
}

/// The fuzz harnesses hold on a few thousand pseudo-random programs (the fuzzer runs
/// many more; this keeps the harnesses themselves honest in `cargo test`).
#[test]
fn session_harnesses_hold_on_random_programs() {
    for input in random_inputs(3000, 400) {
        run_sender(&input).unwrap_or_else(|v| panic!("sender: {v} on {input:?}"));
        run_receiver(&input).unwrap_or_else(|v| panic!("receiver: {v} on {input:?}"));
        run_decode(&input).unwrap_or_else(|v| panic!("decode: {v} on {input:?}"));
    }
}
