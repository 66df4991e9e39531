//! The C ABI from C: the programs in `ffi_tests/` (which include only `toroid.h`, through the
//! tests' helper header) are compiled with the system C compiler and run as real processes under
//! `toroid-run`:
//!
//! - `collectives.c`: every collective, blocking and async, checked element by element against
//!   a reference, on 2..=5 ranks and all three ways of creating a communicator;
//! - `errors.c`: every error path of the ABI, each asserted;
//! - `stats.c`: `toroid_comm_stats` counts exactly, sizes the caller's array and truncates;
//! - `dlopen.c`: libtoroid.so loaded with dlopen, every entry point resolved with dlsym; also
//!   with libcuda, libnvrtc and libibverbs hidden from dlopen (`hide_libs.c`, an interposer);
//! - `lifecycle.c` under valgrind: create -> collectives -> destroy, repeated, with no error,
//!   no leak, and no memory still reachable that grows with the number of iterations;
//! - `quickstart.c` (the C quick start of docs/C_AND_PYTHON.md), built with pkg-config's flags.
//!
//! Every run is bounded by toroid-run's `--timeout`, which kills all ranks when it passes.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::{Mutex, OnceLock};

fn crate_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn toroid_run() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_toroid-run"))
}

/// The directory of the libtoroid.so that this test build produced: cargo leaves the fresh one
/// in `deps/` when it builds tests (the copy beside the binaries is refreshed by `cargo build`).
fn lib_dir() -> PathBuf {
    let profile = toroid_run().parent().expect("toroid-run has a directory").to_path_buf();
    let deps = profile.join("deps");
    if deps.join("libtoroid.so").exists() { deps } else { profile }
}

/// A temporary directory removed when dropped (also when a test fails).
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("toroid-ffi-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("creating a temporary directory");
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn out_dir() -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join("ffi_tests");
    std::fs::create_dir_all(&d).expect("creating the C build directory");
    d
}

fn check(out: &Output, what: &str) {
    assert!(
        out.status.success(),
        "{what} failed ({}):\n--- stdout\n{}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Compiles `ffi_tests/<name>.c` (once per test run) and returns the executable.
fn build(name: &str) -> PathBuf {
    static BUILT: OnceLock<Mutex<HashMap<String, PathBuf>>> = OnceLock::new();
    let mut built = BUILT.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = built.get(name) {
        return p.clone();
    }
    let exe = out_dir().join(name);
    let lib = lib_dir();
    let mut cmd = Command::new(std::env::var_os("CC").unwrap_or_else(|| "cc".into()));
    cmd.args(["-std=c11", "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-pedantic"])
        .arg("-I")
        .arg(crate_dir().join("include"))
        .arg(crate_dir().join("ffi_tests").join(format!("{name}.c")))
        .arg("-o")
        .arg(&exe);
    if name == "dlopen" {
        cmd.arg("-ldl"); // not linked with toroid: it loads it
    } else {
        cmd.arg("-L").arg(&lib).arg("-ltoroid").arg(format!("-Wl,-rpath,{}", lib.display()));
    }
    cmd.arg("-lm");
    check(&cmd.output().expect("the C compiler (cc) runs"), &format!("compiling ffi_tests/{name}.c"));
    built.insert(name.to_string(), exe.clone());
    exe
}

/// Runs `program args` on `n` ranks under toroid-run, bounded by `timeout_s`.
fn run_ranks(n: usize, timeout_s: u32, env: &[(&str, &str)], program: &[&std::ffi::OsStr]) -> Output {
    let mut cmd = Command::new(toroid_run());
    cmd.args(["-n", &n.to_string(), "--timeout", &timeout_s.to_string(), "--grace", "2"]);
    for (k, v) in env {
        cmd.arg("--env").arg(format!("{k}={v}"));
    }
    cmd.arg("--").args(program).stdin(Stdio::null());
    cmd.output().expect("toroid-run starts")
}

/// Asserts that every rank printed a line containing `needle`.
fn every_rank_says(out: &Output, n: usize, needle: &str) {
    let stdout = String::from_utf8_lossy(&out.stdout);
    for r in 0..n {
        assert!(
            stdout.lines().any(|l| l.starts_with(&format!("[{r}]: ")) && l.contains(needle)),
            "rank {r} did not report {needle:?}:\n{stdout}"
        );
    }
}

fn collectives(n: usize, mode: &str) {
    let exe = build("collectives");
    let dir = TempDir::new(&format!("collectives-{n}-{mode}"));
    let out = run_ranks(n, 240, &[], &[exe.as_os_str(), std::ffi::OsStr::new(mode), dir.0.as_os_str()]);
    check(&out, &format!("collectives.c on {n} ranks ({mode})"));
    every_rank_says(&out, n, &format!("of {n}: collectives passed"));
}

#[test]
fn c_collectives_on_2_ranks_from_the_environment() {
    collectives(2, "env");
}

#[test]
fn c_collectives_on_3_ranks_from_a_config() {
    collectives(3, "config");
}

#[test]
fn c_collectives_on_4_ranks_through_a_caller_supplied_store() {
    collectives(4, "store");
}

#[test]
fn c_collectives_on_2_ranks_through_a_store_with_a_config() {
    collectives(2, "store_config");
}

#[test]
fn c_collectives_on_5_ranks_from_the_environment() {
    collectives(5, "env");
}

#[test]
fn c_stats_count_every_operation_and_size_the_array() {
    let exe = build("stats");
    let out = run_ranks(2, 120, &[], &[exe.as_os_str()]);
    check(&out, "stats.c");
    every_rank_says(&out, 2, "stats passed");
}

#[test]
fn c_stats_over_tcp_count_the_bytes_moved() {
    let exe = build("stats");
    let out =
        run_ranks(2, 120, &[("TOROID_SHM_DISABLE", "1")], &[exe.as_os_str(), std::ffi::OsStr::new("tcp")]);
    check(&out, "stats.c over tcp");
    every_rank_says(&out, 2, "stats passed");
}

#[test]
fn c_error_paths() {
    let exe = build("errors");
    let out = run_ranks(2, 120, &[], &[exe.as_os_str()]);
    check(&out, "errors.c");
    every_rank_says(&out, 2, "error paths passed");
}

#[test]
fn c_dump_writes_the_stall_report_into_the_buffer() {
    let exe = build("dump");
    let out = run_ranks(2, 120, &[], &[exe.as_os_str()]);
    check(&out, "dump.c");
    every_rank_says(&out, 2, "dump passed");
}

#[test]
fn c_health_writes_the_document_into_the_buffer() {
    let exe = build("health");
    let out = run_ranks(3, 120, &[], &[exe.as_os_str()]);
    check(&out, "health.c");
    every_rank_says(&out, 3, "health passed");
}

#[test]
fn c_dlopen_resolves_every_entry_point() {
    let exe = build("dlopen");
    let so = lib_dir().join("libtoroid.so");
    // Every function the header declares is in dlopen.c's list.
    let header =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("include/toroid.h")).unwrap();
    let source =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("ffi_tests/dlopen.c")).unwrap();
    let declared: Vec<&str> = header
        .lines()
        .filter(|l| l.starts_with(|c: char| c.is_ascii_lowercase()) && l.contains('('))
        .filter_map(|l| Some(l.split('(').next()?.split_whitespace().last()?.trim_start_matches('*')))
        .filter(|name| name.starts_with("toroid_"))
        .collect();
    assert!(declared.len() > 30, "found only {declared:?} in the header");
    for name in &declared {
        assert!(source.contains(&format!("\"{name}\"")), "dlopen.c does not resolve {name}");
    }
    let out = run_ranks(3, 120, &[], &[exe.as_os_str(), so.as_os_str()]);
    check(&out, "dlopen.c");
    every_rank_says(
        &out,
        3,
        &format!("resolved {} entry points with dlsym; collectives passed", declared.len()),
    );
}

#[test]
fn libtoroid_needs_no_cuda_nvrtc_or_verbs_library_to_load() {
    // cudarc opens libcuda and libnvrtc when first used: nothing of CUDA (or RDMA) may be a
    // load-time dependency, or libtoroid would not load on machines without them. (This
    // machine may have none: then c_dlopen_resolves_every_entry_point loads it without them.)
    let so = lib_dir().join("libtoroid.so");
    let out = Command::new("readelf").arg("-d").arg(&so).output().expect("readelf (binutils) runs");
    assert!(out.status.success(), "readelf -d {}", so.display());
    let dynamic = String::from_utf8_lossy(&out.stdout);
    let needed: Vec<&str> = dynamic.lines().filter(|l| l.contains("(NEEDED)")).collect();
    assert!(!needed.is_empty(), "no NEEDED entries read from {}:\n{dynamic}", so.display());
    for l in &needed {
        for lib in ["libcuda", "libnvrtc", "libcudart", "libibverbs"] {
            assert!(!l.contains(lib), "libtoroid.so needs {lib} at load time: {l}");
        }
    }
}

#[test]
fn libtoroid_loads_and_runs_with_cuda_and_verbs_hidden_from_the_loader() {
    // As on a machine without CUDA or RDMA: an LD_PRELOAD interposer (ffi_tests/hide_libs.c)
    // makes every dlopen of those libraries fail, then dlopen.c loads libtoroid and runs
    // collectives. With the feature `rdma`, rdma-core-mummy's constructor tries libibverbs
    // when libtoroid loads: it must be refused, and libtoroid must load and work all the same.
    let dir = out_dir();
    let hide = dir.join("hide_libs.so");
    let mut cc = Command::new(std::env::var_os("CC").unwrap_or_else(|| "cc".into()));
    cc.args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic", "-shared", "-fPIC"])
        .arg(crate_dir().join("ffi_tests/hide_libs.c"))
        .arg("-o")
        .arg(&hide)
        .arg("-ldl");
    check(&cc.output().expect("the C compiler (cc) runs"), "compiling ffi_tests/hide_libs.c");
    let exe = build("dlopen");
    let so = lib_dir().join("libtoroid.so");
    let preload = hide.display().to_string();
    let env = [
        ("LD_PRELOAD", preload.as_str()),
        ("TOROID_TEST_HIDE", "libcuda,libnvrtc,libcudart,libibverbs,libmlx5,librdmacm,libibumad"),
    ];
    let out = run_ranks(2, 120, &env, &[exe.as_os_str(), so.as_os_str()]);
    check(&out, "dlopen.c with CUDA and verbs hidden");
    every_rank_says(&out, 2, "collectives passed");
    let stderr = String::from_utf8_lossy(&out.stderr);
    if cfg!(feature = "rdma") {
        assert!(
            stderr.contains("hide_libs: refused libibverbs.so.1"),
            "libibverbs was not even tried:\n{stderr}"
        );
    }
}

/// Runs lifecycle.c for `iters` iterations on 2 ranks under valgrind; returns each rank's
/// "still reachable" bytes.
fn valgrind_lifecycle(iters: u32) -> Vec<u64> {
    let exe = build("lifecycle");
    let dir = TempDir::new(&format!("lifecycle-{iters}"));
    let vg = Command::new("valgrind").arg("--version").output();
    assert!(
        vg.is_ok_and(|o| o.status.success()),
        "valgrind is needed for this test (apt-get install valgrind)"
    );
    let iters_s = iters.to_string();
    let args: Vec<&std::ffi::OsStr> = [
        "valgrind",
        "--error-exitcode=99",
        "--leak-check=full",
        "--show-leak-kinds=definite,indirect,possible",
        "--errors-for-leak-kinds=definite,indirect,possible",
        "--fair-sched=yes",
    ]
    .iter()
    .map(std::ffi::OsStr::new)
    .chain([exe.as_os_str(), dir.0.as_os_str(), std::ffi::OsStr::new(&iters_s)])
    .collect();
    // The SIGUSR1 watcher (`TOROID_DUMP_ON_SIGNAL`) is one thread per process that lives until
    // exit by design; valgrind counts the thread's own TLS block (288 bytes) as possibly lost
    // while it runs. It is off here so that the check stays strict for what create/destroy
    // cycles allocate.
    let out = run_ranks(2, 600, &[("TOROID_TIMEOUT", "300"), ("TOROID_DUMP_ON_SIGNAL", "0")], &args);
    check(&out, &format!("lifecycle.c under valgrind ({iters} iterations)"));
    every_rank_says(&out, 2, &format!("{iters} create/collectives/destroy iterations passed"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    for r in 0..2 {
        let mine: Vec<&str> = stderr.lines().filter(|l| l.starts_with(&format!("[{r}]: =="))).collect();
        assert!(
            mine.iter().any(|l| l.contains("ERROR SUMMARY: 0 errors")),
            "rank {r}: valgrind reported errors:\n{stderr}"
        );
        for kind in ["definitely lost", "indirectly lost", "possibly lost"] {
            assert!(
                !mine.iter().any(|l| l.contains(kind) && !l.contains(&format!("{kind}: 0 bytes"))),
                "rank {r}: {kind}:\n{stderr}"
            );
        }
    }
    (0..2)
        .map(|r| {
            stderr
                .lines()
                .filter(|l| l.starts_with(&format!("[{r}]: ==")))
                .find_map(|l| l.split("still reachable: ").nth(1))
                .and_then(|s| s.split(" bytes").next())
                .map_or(0, |s| s.replace(',', "").parse().unwrap_or(0))
        })
        .collect()
}

#[test]
fn c_lifecycle_under_valgrind_has_no_errors_and_no_leaks() {
    let few = valgrind_lifecycle(2);
    let many = valgrind_lifecycle(6);
    eprintln!("still reachable at exit: {few:?} bytes after 2 iterations, {many:?} after 6");
    // What stays reachable at exit is one-time global state (logging, configuration); it must
    // not grow with the number of communicators created and destroyed (a handle registry that
    // kept them would show here, not as "lost").
    for r in 0..2 {
        assert!(
            many[r] <= few[r] + 1024,
            "rank {r}: still reachable grew from {} to {} bytes",
            few[r],
            many[r]
        );
    }
}

#[test]
fn header_compiles_as_c99_c11_and_cpp() {
    let header = crate_dir().join("include/toroid.h");
    for (compiler, std) in [("cc", "-std=c99"), ("cc", "-std=c11"), ("c++", "-std=c++17")] {
        let lang = if compiler == "c++" { "c++" } else { "c" };
        let out = Command::new(compiler)
            .args([std, "-Wall", "-Wextra", "-Werror", "-pedantic", "-fsyntax-only", "-x", lang])
            .arg(&header)
            .output()
            .expect("the compiler runs");
        check(&out, &format!("{compiler} {std} on toroid.h"));
    }
}

#[test]
fn quick_start_builds_with_pkg_config_and_runs() {
    // build.rs writes toroid.pc beside the build's output: target/<profile>/toroid.pc.
    let profile = toroid_run().parent().expect("toroid-run has a directory");
    let flags = Command::new("pkg-config")
        .args(["--cflags", "--libs", "toroid"])
        .env("PKG_CONFIG_PATH", profile)
        .output()
        .expect("pkg-config runs");
    check(&flags, "pkg-config --cflags --libs toroid");
    let flags = String::from_utf8_lossy(&flags.stdout).to_string();
    assert!(flags.contains(&format!("-I{}", crate_dir().join("include").display())), "{flags}");
    assert!(flags.contains("-ltoroid"), "{flags}");
    let exe = out_dir().join("quickstart");
    // `cargo test` alone leaves the fresh library only in `deps/` (the copy that toroid.pc
    // names appears on `cargo build`), so that directory is searched first: the flags under
    // test are still the ones pkg-config printed.
    let lib = lib_dir();
    let out = Command::new("cc")
        .arg(crate_dir().join("ffi_tests/quickstart.c"))
        .arg("-o")
        .arg(&exe)
        .arg(format!("-L{}", lib.display()))
        .args(flags.split_whitespace())
        .output()
        .expect("cc runs");
    check(&out, "compiling the quick start with pkg-config's flags");
    // The library of this test build; LD_LIBRARY_PATH wins over the run path.
    let out = run_ranks(3, 60, &[("LD_LIBRARY_PATH", &lib.display().to_string())], &[exe.as_os_str()]);
    check(&out, "quickstart");
    every_rank_says(&out, 3, "sum of ranks = 3");
}

#[test]
fn c_shrink_leaves_out_a_rank_and_the_survivors_all_reduce() {
    let exe = build("shrink");
    let out = run_ranks(3, 60, &[], &[exe.as_os_str()]);
    check(&out, "shrink.c on 3 ranks");
    let stdout = String::from_utf8_lossy(&out.stdout);
    for r in [0, 2] {
        assert!(
            stdout.lines().any(|l| l.starts_with(&format!("[{r}]: ")) && l.contains("shrink passed")),
            "rank {r} did not pass:\n{stdout}"
        );
    }
}

#[test]
fn c_grow_admits_a_new_process_after_a_shrink() {
    let exe = build("grow");
    let dir = TempDir::new("grow");
    let token = dir.0.join("token");
    let out = run_ranks(3, 60, &[], &[exe.as_os_str(), token.as_os_str()]);
    check(&out, "grow.c on 3 processes");
    every_rank_says(&out, 3, "grow passed");
}

#[test]
fn c_non_blocking_creation_and_shrink_poll_wait_and_abort() {
    let exe = build("pending");
    let out = run_ranks(3, 60, &[], &[exe.as_os_str()]);
    check(&out, "pending.c on 3 ranks");
    let stdout = String::from_utf8_lossy(&out.stdout);
    for r in [0, 2] {
        assert!(
            stdout.lines().any(|l| l.starts_with(&format!("[{r}]: ")) && l.contains("pending passed")),
            "rank {r} did not pass:\n{stdout}"
        );
    }
    assert!(stdout.lines().any(|l| l.starts_with("[0]: abort took")), "{stdout}");
}

#[test]
fn c_wire_all_reduce_is_within_its_bound_and_identical_on_every_rank() {
    let exe = build("wire");
    for (n, env) in [(3, &[][..]), (4, &[("TOROID_SHM_DISABLE", "1")][..])] {
        let out = run_ranks(n, 60, env, &[exe.as_os_str()]);
        check(&out, &format!("wire.c on {n} ranks {env:?}"));
        every_rank_says(&out, n, "wire passed");
    }
}

#[test]
fn c_group_packs_small_all_reduces_runs_the_rest_in_order_and_sends_side_by_side() {
    let exe = build("group");
    for (n, env) in [(3, &[][..]), (5, &[("TOROID_SHM_DISABLE", "1")][..])] {
        let out = run_ranks(n, 60, env, &[exe.as_os_str()]);
        check(&out, &format!("group.c on {n} ranks {env:?}"));
        every_rank_says(&out, n, "group passed");
    }
}
