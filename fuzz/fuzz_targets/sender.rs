//! The sender session fed a program of peer frames, write outcomes, digest results, aborts, time and peer loss; the driver model checks drain-before-release, one outcome per submission, and that everything ends once time is driven forward.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Err(v) = kvwire_model::single::run_sender(data) {
        panic!("invariant broken: {v}");
    }
});
