//! Fuzz target `handshake`: see `toroid::fuzzing::handshake`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = toroid::fuzzing::handshake(data);
});
