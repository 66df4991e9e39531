//! Unit tests of the tuning table ([`super`]).

use super::*;

fn model() -> CostModel {
    CostModel {
        intra: LinkCost { alpha: 5e-6, beta: 1.0 / 10e9 },
        inter: LinkCost { alpha: 50e-6, beta: 1.0 / 1.25e9 },
        host_link_beta: None,
        gamma: 1.0 / 20e9,
        source: "test".into(),
    }
}

#[test]
fn step_counts_follow_the_formulas() {
    let m = model();
    for (n, k) in [(8usize, 4usize), (1088, 4), (2176, 4), (64, 8)] {
        let s = Shape::uniform(n, n / k);
        let (x, y) = s.grid;
        assert_eq!(m.predict(Algorithm::Ring, 1 << 20, &s).steps, 2 * (n - 1));
        assert_eq!(m.predict(Algorithm::Torus2d, 1 << 20, &s).steps, 2 * (x - 1) + 2 * (y - 1));
        assert_eq!(m.predict(Algorithm::HierarchicalRing, 1 << 20, &s).steps, 4 * (k - 1) + 2 * (n / k - 1));
    }
    // The torus's vertical phase moves 1/X of what the hierarchical ring's inter phase does
    // per rank; with the X columns sharing a host's link the link carries the same.
    let s = Shape::uniform(16, 4);
    let t = m.predict(Algorithm::Torus2d, 1 << 20, &s);
    let h = m.predict(Algorithm::HierarchicalRing, 1 << 20, &s);
    assert!((t.inter_bytes - h.inter_bytes).abs() < 1.0);
}

#[test]
fn torus_grids_that_are_not_hosts_count_every_phase_crossing_a_host_link() {
    let m = model();
    let b = 1usize << 24;
    let bf = b as f64;
    // 16 ranks, 4 per host (hosts are blocks of consecutive ranks).
    // The plain torus (its pipelined form is tested below).
    let shape = |grid: (usize, usize)| Shape {
        grid,
        rows_are_hosts: false,
        pipeline_chunk: 0,
        ..Shape::uniform(16, 4)
    };
    let ring = m.predict(Algorithm::Ring, b, &Shape::uniform(16, 4));
    // 1x16 and 16x1 are flat rings: the host link carries what the ring's does.
    for grid in [(1, 16), (16, 1)] {
        let t = m.predict(Algorithm::Torus2d, b, &shape(grid));
        assert!((t.inter_bytes - ring.inter_bytes).abs() < 1.0, "{grid:?}: {t:?} vs {ring:?}");
    }
    // 2x8: rows inside hosts; two column rings per host share its link.
    let t = m.predict(Algorithm::Torus2d, b, &shape((2, 8)));
    assert!((t.inter_bytes - 2.0 * (2.0 * 7.0 / 8.0 * bf / 2.0)).abs() < 1.0, "{t:?}");
    // 8x2: each row spans two hosts (its ring crosses each link once per phase), and four
    // column rings per host share its link.
    let t = m.predict(Algorithm::Torus2d, b, &shape((8, 2)));
    let expected = 2.0 * 7.0 / 8.0 * bf + 4.0 * (2.0 * 0.5 * bf / 8.0);
    assert!((t.inter_bytes - expected).abs() < 1.0, "{t:?}");
    // Two interfaces per host carry the shared column traffic in parallel.
    let two = Shape { nics: 2, ..shape((8, 2)) };
    assert!(m.predict(Algorithm::Torus2d, b, &two).time < t.time);
}

#[test]
fn the_torus_is_pipelined_where_its_row_phases_cost_more_than_its_chunks_latencies() {
    let b = 16 << 20;
    let plain = Shape { pipeline_chunk: 0, ..Shape::uniform(8, 4) };
    let auto = Shape { pipeline_chunk: 4 << 20, ..plain.clone() };
    // Rows as slow as the column (8 ranks sharing 2 cores): four chunks, cheaper.
    let slow_rows = CostModel { intra: LinkCost { alpha: 5e-6, beta: 1.0 / 1.25e9 }, ..model() };
    let (a, p) =
        (slow_rows.predict(Algorithm::Torus2d, b, &plain), slow_rows.predict(Algorithm::Torus2d, b, &auto));
    assert_eq!((a.chunks, p.chunks), (1, 4));
    assert!(p.time < a.time, "{p:?} vs {a:?}");
    assert_eq!(p.inter_bytes, a.inter_bytes);
    assert_eq!(p.steps, 4 * a.steps, "four chunks, each the whole schedule");
    assert_eq!(slow_rows.torus_chunks(b, &auto, None), 4);
    // Free rows: nothing to hide, and each chunk pays the column's latencies again.
    let free_rows = CostModel { intra: LinkCost { alpha: 0.0, beta: 0.0 }, ..model() };
    assert_eq!(
        free_rows.predict(Algorithm::Torus2d, b, &auto),
        free_rows.predict(Algorithm::Torus2d, b, &plain)
    );
    // Forced (`TOROID_PIPELINE_CHUNK` set): pipelined anyway, at its own price.
    let forced = Shape { pipeline_forced: true, ..auto.clone() };
    let f = free_rows.predict(Algorithm::Torus2d, b, &forced);
    assert!(f.chunks == 4 && f.time > free_rows.predict(Algorithm::Torus2d, b, &plain).time, "{f:?}");
    // Below two chunks, or on one row or column, never.
    assert_eq!(slow_rows.torus_chunks((8 << 20) - 1, &forced, None), 1);
    assert_eq!(slow_rows.torus_chunks(b, &Shape { grid: (1, 8), ..forced.clone() }, None), 1);
}

#[test]
fn compressed_all_reduces_halve_the_bytes_between_hosts_only() {
    let m = model();
    let b = 1usize << 24;
    // 4 hosts x 2 ranks: the torus, exact rows, the column's bytes halved.
    let s = Shape::uniform(8, 4);
    let exact = m.predict(Algorithm::Torus2d, b, &s);
    let half = m.predict_compressed(b, 0.5, &s);
    assert_eq!((half.algo, half.steps), (Algorithm::Torus2d, exact.steps));
    assert!((half.inter_bytes - exact.inter_bytes / 2.0).abs() < 1.0, "{half:?} vs {exact:?}");
    assert!(half.time < exact.time);
    // The time saved is the column's halved bytes less the rounding and widening.
    let col = exact.inter_bytes / 2.0 * m.inter.beta;
    let convert = 2.0 * b as f64 / 2.0 * m.gamma;
    assert!((exact.time - half.time - (col - convert)).abs() < 1e-9, "{half:?} vs {exact:?}");
    // One rank per host, or one host: the flat form, the ring's steps at half the bytes.
    for s in [Shape::uniform(4, 4), Shape::uniform(4, 1)] {
        let ring = m.predict(Algorithm::Ring, b, &s);
        let half = m.predict_compressed(b, 0.5, &s);
        assert_eq!((half.algo, half.steps), (Algorithm::Ring, ring.steps));
        assert!((half.inter_bytes - ring.inter_bytes / 2.0).abs() < 1.0);
    }
    // A ratio of 1 costs only the conversions.
    let same = m.predict_compressed(b, 1.0, &s);
    assert!((same.time - exact.time - 2.0 * b as f64 / 2.0 * m.gamma).abs() < 1e-9);
}

#[test]
fn small_messages_pick_few_steps_and_large_ones_few_bytes() {
    let m = model();
    let s = Shape::uniform(8, 1);
    let f = AlgoFilter::default();
    let small = choose(&f, &m, &s, CollKind::AllReduce, 1024);
    assert!(matches!(small, Algorithm::Doubling | Algorithm::HalvingDoubling), "{small}");
    let big = choose(&f, &m, &s, CollKind::AllReduce, 256 << 20);
    assert!(matches!(big, Algorithm::Ring | Algorithm::Torus2d | Algorithm::HalvingDoubling), "{big}");
    assert_eq!(choose(&f, &m, &s, CollKind::Broadcast, 64 << 20), Algorithm::Chain);
    assert_eq!(choose(&f, &m, &s, CollKind::Broadcast, 64), Algorithm::Tree);
    assert_eq!(choose(&f, &m, &s, CollKind::AllToAll, 64), Algorithm::Pairwise);
}

#[test]
fn filter_syntax() {
    let m = model();
    let s = Shape::uniform(4, 1);
    let f = AlgoFilter::parse("ring;broadcast:^chain").unwrap();
    assert_eq!(choose(&f, &m, &s, CollKind::AllReduce, 16), Algorithm::Ring);
    assert_eq!(choose(&f, &m, &s, CollKind::Broadcast, 1 << 30), Algorithm::Tree);
    // A global list that names nothing a collective can run leaves it all its candidates.
    assert_eq!(choose(&f, &m, &s, CollKind::AllToAll, 1), Algorithm::Pairwise);
    let f = AlgoFilter::parse("allreduce:rd").unwrap();
    assert_eq!(choose(&f, &m, &s, CollKind::AllReduce, 1 << 30), Algorithm::Doubling);
    assert!(AlgoFilter::parse("warp").is_err());
    assert!(AlgoFilter::parse("gossip:ring").is_err());
    assert_eq!(AlgoFilter::parse("").unwrap(), AlgoFilter::default());
}

#[test]
fn intra_choice_follows_the_filter() {
    let none = AlgoFilter::default();
    assert_eq!(none.choose_intra(CollKind::AllReduce, 4096, 4), Some(Algorithm::ShmDirect));
    assert_eq!(none.choose_intra(CollKind::AllToAll, 4096, 4), None);
    assert_eq!(none.choose_intra(CollKind::AllReduce, 4096, 1), None);
    let ring = AlgoFilter::parse("ring").unwrap();
    assert_eq!(ring.choose_intra(CollKind::AllReduce, 1 << 20, 4), None);
    let only = AlgoFilter::parse("allreduce:ring").unwrap();
    assert_eq!(only.choose_intra(CollKind::AllReduce, 1 << 20, 4), None);
    assert_eq!(only.choose_intra(CollKind::Broadcast, 1 << 20, 4), Some(Algorithm::ShmDirect));
    let excl = AlgoFilter::parse("^shm_direct").unwrap();
    assert_eq!(excl.choose_intra(CollKind::AllGather, 1 << 20, 4), None);
    let forced = AlgoFilter::parse("shm_direct").unwrap();
    assert_eq!(forced.choose_intra(CollKind::AllReduce, 8, 2), Some(Algorithm::ShmDirect));
    // Not a candidate of the cost model: without the window the filter leaves the others.
    let other = choose(&forced, &model(), &Shape::uniform(2, 1), CollKind::AllReduce, 8);
    assert_ne!(other, Algorithm::ShmDirect);
    assert!(check_forced(CollKind::AllGather, Algorithm::ShmDirect).is_ok());
    assert!(check_forced(CollKind::Reduce, Algorithm::ShmDirect).is_err());
    // A barrier on one host posts and waits in the window, unless told to disseminate.
    assert_eq!(none.choose_intra(CollKind::Barrier, 0, 3), Some(Algorithm::ShmDirect));
    let dis = AlgoFilter::parse("barrier:dissemination").unwrap();
    assert_eq!(dis.choose_intra(CollKind::Barrier, 0, 3), None);
    assert!(check_forced(CollKind::Barrier, Algorithm::ShmDirect).is_ok());
    // So does a split's exchange (an all-gather): neither links pairs of the host.
    assert_eq!(none.choose_intra(CollKind::Split, 64, 3), Some(Algorithm::ShmDirect));
}

#[test]
fn cost_model_syntax() {
    assert_eq!(CostModel::parse("probe").unwrap(), None);
    assert_eq!(CostModel::parse("default").unwrap(), Some(CostModel::default()));
    let m = CostModel::parse("intra=5/10,inter=50/0.125,reduce=20").unwrap().unwrap();
    assert!((m.inter.beta - 8e-9).abs() < 1e-15 && (m.intra.alpha - 5e-6).abs() < 1e-12);
    assert!(CostModel::parse("intra=5").is_err());
    assert!(CostModel::parse("fast").is_err());
    let l = CostModel::parse("inter=50/0.125,link=0.5").unwrap().unwrap();
    assert_eq!(l.host_link_beta, Some(2e-9));
    assert_eq!(m.host_link_beta, None);
}

#[test]
fn streams_sharing_a_host_link_run_at_the_lesser_of_a_stream_and_their_share_of_the_link() {
    // 4 hosts x 2 ranks, the torus's two column rings leave each host together; one
    // stream 125 MB/s, no intra cost to speak of.
    let shape = Shape { segment: 1, ..Shape::uniform(8, 4) };
    let base = CostModel {
        intra: LinkCost { alpha: 0.0, beta: 1e-15 },
        inter: LinkCost { alpha: 0.0, beta: 8e-9 },
        host_link_beta: None,
        gamma: 1e-15,
        source: "test".into(),
    };
    let b = 16 << 20;
    let column = |m: &CostModel| m.predict(Algorithm::Torus2d, b, &shape).time;
    // Each column ring carries 2 (Y-1)/Y * B/X = 2 * 3/4 * B/2 bytes.
    let per_stream = 0.75 * b as f64;
    // Without a link measurement the two streams share one stream's bandwidth.
    let shared = column(&base);
    assert!((shared - 2.0 * per_stream * 8e-9).abs() / shared < 1e-3, "{shared}");
    // A link 4x a stream: each stream runs at its own cap, twice as fast.
    let wide = CostModel { host_link_beta: Some(2e-9), ..base.clone() };
    assert!((column(&wide) - per_stream * 8e-9).abs() / shared < 1e-3, "{}", column(&wide));
    // A link 1.5x a stream: the two share it.
    let mid = CostModel { host_link_beta: Some(8e-9 / 1.5), ..base.clone() };
    let want = 2.0 * per_stream * 8e-9 / 1.5;
    assert!((column(&mid) - want).abs() / want < 1e-3, "{}", column(&mid));
    // One stream per host (hring) runs at one stream's rate whatever the link.
    let h = |m: &CostModel| m.predict(Algorithm::HierarchicalRing, b, &Shape::uniform(4, 4)).time;
    assert!((h(&wide) - h(&base)).abs() < 1e-12);
}

#[test]
fn forced_choice_must_fit() {
    assert!(check_forced(CollKind::AllReduce, Algorithm::Ring).is_ok());
    assert!(check_forced(CollKind::AllGather, Algorithm::Doubling).is_err());
}
