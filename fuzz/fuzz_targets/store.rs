//! Fuzz target `store`: see `toroid::fuzzing::store_session`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = toroid::fuzzing::store_session(data);
});
