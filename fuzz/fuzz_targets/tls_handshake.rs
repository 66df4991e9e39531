//! Fuzz target `tls_handshake`: see `toroid::fuzzing::tls_handshake`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = toroid::fuzzing::tls_handshake(data);
});
