//! Fuzz target `frame`: see `toroid::fuzzing::frame`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = toroid::fuzzing::frame(data);
});
