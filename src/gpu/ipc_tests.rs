//! The IPC path's plain logic: records, mappings, segments (no GPU needed).

use super::*;

fn record(pid: u32, device: u32, ptr: u64) -> WindowRecord {
    let mut handle = [0u8; 64];
    handle[0] = ptr as u8;
    WindowRecord { usable: true, device, pid, bytes: WINDOW as u64, ptr, handle }
}

#[test]
fn records_round_trip_and_reject_what_is_not_one() {
    let r = record(77, 3, 0xdead_beef_0000);
    let b = r.encode();
    assert_eq!(WindowRecord::decode(1, &b).unwrap(), r);
    assert!(!WindowRecord::decode(1, &WindowRecord::unusable().encode()).unwrap().usable);
    assert!(WindowRecord::decode(1, &b[..95]).is_err(), "short");
    let mut bad = b;
    bad[0] = b'X';
    assert!(WindowRecord::decode(1, &bad).unwrap_err().to_string().contains("rank 1"), "magic");
    let mut bad = b;
    bad[4] = 2;
    assert!(WindowRecord::decode(1, &bad).is_err(), "version");
    let mut bad = b;
    bad[6] = 2;
    assert!(WindowRecord::decode(1, &bad).is_err(), "flags");
}

#[test]
fn each_peer_of_another_process_is_opened_once_and_same_process_peers_not_at_all() {
    // Ranks 0 and 2 in process 10, ranks 1 and 3 in process 20; rank 0 maps.
    let recs = [record(10, 0, 0x100), record(20, 0, 0x200), record(10, 0, 0x300), record(20, 0, 0x400)];
    let mut opened = Vec::new();
    let m = map_windows(
        0,
        &recs,
        |k, h| {
            opened.push((k, h[0]));
            Ok(0x9000 + k as u64)
        },
        |_| panic!("nothing to close"),
    )
    .unwrap();
    assert_eq!(
        m,
        [Mapping::Own(0x100), Mapping::Opened(0x9001), Mapping::SameProcess(0x300), Mapping::Opened(0x9003)]
    );
    assert_eq!(opened, [(1, 0x00), (3, 0x00)], "each other-process peer opened once, with its handle");
    assert_eq!(m.iter().map(|m| m.ptr()).collect::<Vec<_>>(), [0x100, 0x9001, 0x300, 0x9003]);
}

#[test]
fn a_failure_closes_what_was_opened_and_says_which_rank() {
    let recs = [record(10, 0, 0x100), record(20, 0, 0x200), record(30, 0, 0x300)];
    let mut closed = Vec::new();
    let e = map_windows(
        0,
        &recs,
        |k, _| if k == 2 { Err(Error::Unsupported("no".into())) } else { Ok(0x9000 + k as u64) },
        |p| closed.push(p),
    )
    .unwrap_err();
    assert!(matches!(e, Error::Unsupported(_)));
    assert_eq!(closed, [0x9001], "the handle opened before the failure is closed");

    // An unusable rank, a window of another size, same-process ranks on two devices.
    let mut r = recs.clone();
    r[2] = WindowRecord::unusable();
    let e = map_windows(0, &r, |k, _| Ok(k as u64 + 1), |_| {}).unwrap_err();
    assert!(e.to_string().contains("rank 2 has no device window"), "{e}");
    let mut r = recs.clone();
    r[1].bytes = 1;
    assert!(map_windows(0, &r, |_, _| Ok(1), |_| {}).unwrap_err().to_string().contains("rank 1"));
    let r = [record(10, 0, 0x100), record(10, 1, 0x200)];
    let e = map_windows(0, &r, |_, _| panic!("same process: never opened"), |_| {}).unwrap_err();
    assert!(e.to_string().contains("devices 0 and 1"), "{e}");
}

#[test]
fn segments_cover_the_chunk_in_rank_order_balanced() {
    for count in [0usize, 1, 2, 5, 7, 4099, 1 << 20] {
        for n in 1..=9 {
            let mut next = 0;
            for k in 0..n {
                let (s, l) = segment(count, n, k);
                assert_eq!(s, next, "count {count} n {n} k {k}");
                assert!(l == count / n || l == count / n + 1);
                next = s + l;
            }
            assert_eq!(next, count);
        }
    }
}

#[test]
fn the_records_say_whether_ranks_are_processes_of_their_own_and_how_many_share_a_device() {
    use super::super::window_map::{ranks_on_device, separate_processes};
    let apart = [record(1, 0, 0x10), record(2, 0, 0x20), record(3, 1, 0x30)];
    assert!(separate_processes(&apart));
    assert_eq!((ranks_on_device(0, &apart), ranks_on_device(2, &apart)), (2, 1));
    let threads = [record(1, 0, 0x10), record(1, 0, 0x20), record(3, 0, 0x30)];
    assert!(!separate_processes(&threads));
    assert_eq!(ranks_on_device(1, &threads), 3);
}
