//! The frame decoder: never panics; what decodes re-encodes to the same bytes and decodes to the same frame.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Err(v) = kvwire_model::single::run_decode(data) {
        panic!("invariant broken: {v}");
    }
});
