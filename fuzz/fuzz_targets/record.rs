//! Fuzz target `record`: see `toroid::fuzzing::record`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = toroid::fuzzing::record(data);
});
