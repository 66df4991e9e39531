//! Unit tests of reading the configuration ([`super`]).

use super::*;

fn cfg(pairs: &[(&str, &str)]) -> Result<Config> {
    let map: BTreeMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    Config::from_lookup(|k| map.get(k).cloned())
}

#[test]
fn the_auth_token_is_kept_exactly_and_never_shown() {
    let c = cfg(&[("TOROID_AUTH_TOKEN", " pass phrase ")]).unwrap();
    assert_eq!(c.auth_token.as_ref().map(AuthToken::as_bytes), Some(&b" pass phrase "[..]));
    assert_eq!(c.var("TOROID_AUTH_TOKEN"), Some(REDACTED));
    assert!(!format!("{c:?}").contains("pass phrase"));
    assert!(cfg(&[("TOROID_AUTH_TOKEN", "")]).unwrap().auth_token.is_none());
    assert!(cfg(&[]).unwrap().auth_token.is_none());
}

#[test]
fn defaults_when_nothing_is_set() {
    let c = cfg(&[]).unwrap();
    assert_eq!(c.timeout, DEFAULT_TIMEOUT);
    assert_eq!(c.segment_size, DEFAULT_SEGMENT_SIZE);
    assert!(c.socket_ifname.is_none() && c.algo.is_none() && c.spin.is_none());
}

#[test]
fn parses_values_and_rejects_garbage() {
    let c =
        cfg(&[("TOROID_TIMEOUT", "2.5"), ("TOROID_SEGMENT_SIZE", "1M"), ("TOROID_SPIN_US", "10")]).unwrap();
    assert_eq!(c.timeout, Duration::from_millis(2500));
    assert_eq!(c.segment_size, 1 << 20);
    assert_eq!(c.spin, Some(Duration::from_micros(10)));
    assert!(cfg(&[("TOROID_TIMEOUT", "soon")]).is_err());
    assert!(cfg(&[("TOROID_TIMEOUT", "-1")]).is_err());
    assert!(cfg(&[("TOROID_SEGMENT_SIZE", "12")]).is_err());
    // The pipelined torus: unset (the model decides), off, or forced at a size.
    assert_eq!(cfg(&[]).unwrap().pipeline_chunk, None);
    assert_eq!(cfg(&[("TOROID_PIPELINE_CHUNK", "0")]).unwrap().pipeline_chunk, Some(0));
    assert_eq!(cfg(&[("TOROID_PIPELINE_CHUNK", "2M")]).unwrap().pipeline_chunk, Some(2 << 20));
    assert!(cfg(&[("TOROID_PIPELINE_CHUNK", "100")]).is_err());
    // Durations are capped, so no deadline can overflow (1e19 s once panicked).
    for big in ["1e19", "2592001", "inf"] {
        let e = cfg(&[("TOROID_TIMEOUT", big)]).unwrap_err().to_string();
        assert!(e.contains("TOROID_TIMEOUT"), "{big}: {e}");
    }
    assert_eq!(cfg(&[("TOROID_TIMEOUT", "2592000")]).unwrap().timeout, MAX_TIMEOUT);
    assert!(cfg(&[("TOROID_SPIN_US", "18446744073709551615")]).is_err());
    let far = deadline_in(Duration::MAX);
    assert!(far > std::time::Instant::now() + MAX_TIMEOUT - Duration::from_secs(60));
    // Empty counts as unset.
    assert_eq!(cfg(&[("TOROID_TIMEOUT", "")]).unwrap().timeout, DEFAULT_TIMEOUT);
}

#[test]
fn tcp_congestion_names_are_checked() {
    assert_eq!(cfg(&[]).unwrap().tcp_congestion, None);
    let c = cfg(&[("TOROID_TCP_CONGESTION", " cubic ")]).unwrap();
    assert_eq!(c.tcp_congestion.as_deref(), Some("cubic"));
    for bad in ["cu bic", "a/b", "averyveryverylongname"] {
        let e = cfg(&[("TOROID_TCP_CONGESTION", bad)]).unwrap_err().to_string();
        assert!(e.contains("TOROID_TCP_CONGESTION"), "{bad}: {e}");
    }
}

#[test]
fn shm_settings() {
    let c = cfg(&[]).unwrap();
    assert!(!c.shm_disable);
    assert_eq!(c.shm_dir, std::path::PathBuf::from("/dev/shm"));
    let c =
        cfg(&[("TOROID_SHM_DISABLE", "1"), ("TOROID_SHM_RING_SIZE", "1M"), ("TOROID_SHM_CHUNK_SIZE", "0")])
            .unwrap();
    assert!(c.shm_disable);
    assert_eq!((c.shm_ring_size, c.shm_chunk_size), (1 << 20, 0));
    assert!(!cfg(&[("TOROID_SHM_DISABLE", "off")]).unwrap().shm_disable);
    assert!(c.connect_lazy);
    assert!(!cfg(&[("TOROID_CONNECT", "mesh")]).unwrap().connect_lazy);
    assert!(cfg(&[("TOROID_CONNECT", "LAZY")]).unwrap().connect_lazy);
    assert!(cfg(&[("TOROID_CONNECT", "star")]).is_err());
    assert!(cfg(&[("TOROID_SHM_DISABLE", "maybe")]).is_err());
    assert!(cfg(&[("TOROID_SHM_RING_SIZE", "100")]).is_err());
}

#[test]
fn sockets_per_pair_and_the_test_flow_cap() {
    let c = cfg(&[]).unwrap();
    assert_eq!((c.nsocks, c.test_flow_rate), (0, 0));
    let c = cfg(&[("TOROID_NSOCKS", "4"), ("TOROID_TEST_FLOW_RATE", "1gbit")]).unwrap();
    assert_eq!((c.nsocks, c.test_flow_rate), (4, 125_000_000));
    assert_eq!(cfg(&[("TOROID_TEST_FLOW_RATE", "500mbit")]).unwrap().test_flow_rate, 62_500_000);
    assert_eq!(cfg(&[("TOROID_TEST_FLOW_RATE", "1000")]).unwrap().test_flow_rate, 1000);
    for bad in ["0", "17", "x", "-1"] {
        let e = cfg(&[("TOROID_NSOCKS", bad)]).unwrap_err().to_string();
        assert!(e.contains("TOROID_NSOCKS"), "{bad}: {e}");
    }
    assert!(cfg(&[("TOROID_TEST_FLOW_RATE", "fast")]).is_err());
    assert!(cfg(&[("TOROID_TEST_FLOW_RATE", "0gbit")]).is_err());
    assert_eq!(c.nthreads, 0);
    assert_eq!(cfg(&[("TOROID_NTHREADS", "2")]).unwrap().nthreads, 2);
    assert_eq!(cfg(&[("TOROID_NTHREADS", "0")]).unwrap().nthreads, 0);
    for bad in ["17", "x", "-1"] {
        let e = cfg(&[("TOROID_NTHREADS", bad)]).unwrap_err().to_string();
        assert!(e.contains("TOROID_NTHREADS"), "{bad}: {e}");
    }
}

#[test]
fn rdma_device_and_gid_index() {
    let c = cfg(&[]).unwrap();
    assert_eq!((c.ib_hca.as_deref(), c.ib_gid_index), (None, 0));
    let c = cfg(&[("TOROID_IB_HCA", "mlx5_0:1"), ("TOROID_IB_GID_INDEX", "3")]).unwrap();
    assert_eq!((c.ib_hca.as_deref(), c.ib_gid_index), (Some("mlx5_0:1"), 3));
    for bad in ["256", "-1", "x"] {
        let e = cfg(&[("TOROID_IB_GID_INDEX", bad)]).unwrap_err().to_string();
        assert!(e.contains("TOROID_IB_GID_INDEX"), "{bad}: {e}");
    }
    assert_eq!(c.rdma, RdmaMode::Auto);
    for (v, want) in
        [("off", RdmaMode::Off), ("0", RdmaMode::Off), ("FAKE", RdmaMode::Fake), ("auto", RdmaMode::Auto)]
    {
        assert_eq!(cfg(&[("TOROID_RDMA", v)]).unwrap().rdma, want, "{v}");
    }
    let e = cfg(&[("TOROID_RDMA", "yes please")]).unwrap_err().to_string();
    assert!(e.contains("TOROID_RDMA"), "{e}");
}

#[test]
fn size_suffixes() {
    assert_eq!(parse_size("x", "1G").unwrap(), 1 << 30);
    assert_eq!(parse_size("x", "8k").unwrap(), 8192);
    assert!(parse_size("x", "M").is_err());
    assert!(parse_size("x", "99999999999999T").is_err());
}

#[test]
fn certificate_files_come_all_three_or_not_at_all() {
    let all = [("TOROID_TLS_CA", "/ca.pem"), ("TOROID_TLS_CERT", "/c.pem"), ("TOROID_TLS_KEY", "/k.pem")];
    let f = cfg(&all).unwrap().tls_files.unwrap();
    assert_eq!(
        (f.ca.to_str(), f.cert.to_str(), f.key.to_str()),
        (Some("/ca.pem"), Some("/c.pem"), Some("/k.pem"))
    );
    assert!(cfg(&[]).unwrap().tls_files.is_none());
    for missing in 0..3 {
        let some: Vec<_> = all.iter().enumerate().filter(|(i, _)| *i != missing).map(|(_, kv)| *kv).collect();
        let e = cfg(&some).unwrap_err().to_string();
        assert!(e.contains("all three or none"), "{e}");
    }
}
