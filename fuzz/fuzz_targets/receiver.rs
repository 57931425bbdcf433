//! The receiver session fed a program of peer frames and writes, fence and digest completions, aborts, time and peer loss; the driver model checks fence-before-verify, fence-before-release, that only verified data is delivered, and that every page comes back.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Err(v) = kvwire_model::single::run_receiver(data) {
        panic!("invariant broken: {v}");
    }
});
