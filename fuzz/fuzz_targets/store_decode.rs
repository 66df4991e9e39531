//! Fuzz target `store_decode`: see `toroid::fuzzing::store_decode`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = toroid::fuzzing::store_decode(data);
});
