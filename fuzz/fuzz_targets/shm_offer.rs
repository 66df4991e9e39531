//! Fuzz target `shm_offer`: see `toroid::fuzzing::shm_offer`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = toroid::fuzzing::shm_offer(data);
});
