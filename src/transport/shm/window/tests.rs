//! Unit tests of the shared-memory window ([`super`]).

use super::*;

#[test]
fn slot_words_describe_the_fingerprint_they_hold() {
    use crate::collective::{Algorithm, CollKind};
    let fp = Fingerprint {
        seq: 812,
        kind: CollKind::AllReduce,
        dtype: DataType::F32,
        op: ReduceOp::Max,
        count: 4096,
        root: -1,
        algo: Algorithm::ShmDirect as u8,
    };
    assert_eq!(describe_fp(&fp_words(&fp)), fp.to_string());
    assert!(describe_fp(&[0; 4]).starts_with("an unknown collective"));
}

#[test]
fn streaming_copy_is_a_copy_at_any_alignment_and_length() {
    let src: Vec<u8> = (0..5000u32).map(|i| (i * 31 % 251) as u8).collect();
    for off in [0usize, 1, 7, 16, 31, 33] {
        for len in [0usize, 1, 15, 31, 32, 127, 128, 129, 1000, 4000] {
            let mut dst = vec![0u8; len + 64];
            copy_streaming(&mut dst[off..off + len], &src[3..3 + len]);
            assert_eq!(&dst[off..off + len], &src[3..3 + len], "offset {off}, length {len}");
            assert!(dst[..off].iter().chain(&dst[off + len..]).all(|b| *b == 0), "wrote outside");
        }
    }
}

#[test]
fn the_last_member_to_map_the_window_removes_its_name() {
    use super::super::segment::{Segment, segment_name};
    let dir = std::env::temp_dir().join(format!("toroid-window-test-{}", crate::sys::random::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (members, region) = (3, 4096);
    let len = window_len(members, region);
    let seg = Segment::create(&dir, &segment_name(7, "win"), len).unwrap_or_else(|e| panic!("{}", e.0));
    let path = seg.path().unwrap().to_path_buf();
    let _creator = Window::init(seg, members, 0, region, 7).unwrap();
    let _first = Window::attach(Segment::open(&path, len).unwrap(), members, 1, region, 7).unwrap();
    assert!(path.exists(), "a member has not mapped it yet");
    let _last = Window::attach(Segment::open(&path, len).unwrap(), members, 2, region, 7).unwrap();
    assert!(!path.exists(), "every member mapped it: the name must be gone");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn stages_compare_across_wrap_around() {
    assert!(reached(5, 5) && reached(6, 5) && !reached(4, 5));
    assert!(reached(2, u32::MAX - 1), "2 is three posts after 2^32 - 2");
    assert!(!reached(u32::MAX - 1, 2));
}
