//! The timeline: with `TOROID_TIMELINE=path`, every process writes its operations as Chrome
//! trace events (the format Perfetto and chrome://tracing read; "Trace Event Format", Google)
//! to `path.rank<R>.json`, where R is the rank of the first communicator the process created.
//! `toroid-run` merges the files of a job into `path` when it ends (`merge`).
//!
//! Tracks: one process per rank (pid = R, named "rank R") and one thread per communicator (tid =
//! the communicator's number in this process, named with its id, rank and size). Each operation
//! is a complete ("X") event named after the collective, with its sequence number, count, type,
//! reduction, bytes moved, algorithm and state in `args`; each phase of it (reduce-scatter,
//! all-gather, ...) is an "X" event of category `phase` nested inside it on the same track.
//!
//! A rank's file is in the trace-event format's JSON array form, one event per line, each line
//! ending in a comma and no closing bracket: the format allows that ("the closing ] is
//! optional"), so a rank that is killed leaves a file that still opens. Events go through one
//! buffer per process and reach the file in large writes (and when a communicator is dropped),
//! from the thread that ran the operation, after it completed: the collective's own time does
//! not include them.

use std::fmt::Write as _;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use super::recorder::OnEnd;
use super::snapshot::{OpRecord, PhaseSpan};
use crate::collective::{Algorithm, CollKind};

/// The file of this process, opened by its first communicator.
struct Sink {
    out: BufWriter<File>,
    pid: usize,
    line: String,
}

static SINK: OnceLock<Option<Arc<Mutex<Sink>>>> = OnceLock::new();
static NEXT_TID: AtomicU32 = AtomicU32::new(0);

/// The file rank `rank` writes for a timeline at `path`.
pub fn rank_file(path: &Path, rank: usize) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(format!(".rank{rank}.json"));
    PathBuf::from(s)
}

fn sink(path: &Path, rank: usize) -> Option<Arc<Mutex<Sink>>> {
    SINK.get_or_init(|| {
        let file = rank_file(path, rank);
        match File::create(&file) {
            Ok(f) => {
                let mut out = BufWriter::with_capacity(1 << 16, f);
                let _ = out.write_all(b"[\n");
                tracing::info!(target: "toroid::trace", "timeline: writing {}", file.display());
                Some(Arc::new(Mutex::new(Sink { out, pid: rank, line: String::with_capacity(512) })))
            }
            Err(e) => {
                tracing::warn!(target: "toroid::trace", "timeline: cannot create {}: {e}; no timeline", file.display());
                None
            }
        }
    })
    .clone()
}

/// Flushes the buffer when the communicator that owns the hook goes away.
struct Track {
    sink: Arc<Mutex<Sink>>,
    tid: u32,
}

impl Drop for Track {
    fn drop(&mut self) {
        let mut s = self.sink.lock().unwrap_or_else(|e| e.into_inner());
        let _ = s.out.flush();
    }
}

/// Nanoseconds shown as microseconds with three decimals (exact, no float).
struct Us(u64);

impl std::fmt::Display for Us {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{:03}", self.0 / 1000, self.0 % 1000)
    }
}

/// The hook that writes the operations of one communicator (`rank` of `size`, id `comm_id`)
/// to the timeline at `path`; `None` when the file cannot be created.
pub fn hook(path: &Path, rank: usize, size: usize, comm_id: u64) -> Option<OnEnd> {
    let sink = sink(path, rank)?;
    let tid = NEXT_TID.fetch_add(1, Ordering::Relaxed);
    {
        let mut s = sink.lock().unwrap_or_else(|e| e.into_inner());
        let pid = s.pid;
        let meta = format!(
            "{{\"name\":\"process_name\",\"ph\":\"M\",\"ts\":0,\"pid\":{pid},\"tid\":{tid},\"args\":{{\"name\":\"rank {pid}\"}}}},\n\
             {{\"name\":\"thread_name\",\"ph\":\"M\",\"ts\":0,\"pid\":{pid},\"tid\":{tid},\"args\":{{\"name\":\"comm {comm_id:#x} rank {rank}/{size}\"}}}},\n"
        );
        let _ = s.out.write_all(meta.as_bytes());
    }
    let track = Track { sink, tid };
    Some(Box::new(move |r: &OpRecord, spans: &[PhaseSpan]| track.write(r, spans)))
}

impl Track {
    fn write(&self, r: &OpRecord, spans: &[PhaseSpan]) {
        let mut guard = self.sink.lock().unwrap_or_else(|e| e.into_inner());
        let s = &mut *guard;
        let (pid, tid) = (s.pid, self.tid);
        s.line.clear();
        let fp = &r.fp;
        // Formatted straight into the reused line buffer: no allocation per operation.
        let _ = write!(
            s.line,
            "{{\"name\":\"{}\",\"cat\":\"collective\",\"ph\":\"X\",\"ts\":{},\"dur\":{},\"pid\":{pid},\"tid\":{tid},\
             \"args\":{{\"seq\":{},\"count\":{},\"dtype\":\"{}\"",
            fp.kind.name(),
            Us(r.started_ns),
            Us(r.ended_ns.saturating_sub(r.started_ns)),
            fp.seq,
            fp.count,
            fp.dtype,
        );
        if matches!(fp.kind, CollKind::AllReduce | CollKind::ReduceScatter | CollKind::Reduce) {
            let _ = write!(s.line, ",\"op\":\"{:?}\"", fp.op);
        }
        if fp.root >= 0 {
            let _ = write!(s.line, ",\"root\":{}", fp.root);
        }
        if r.peer >= 0 {
            let _ = write!(s.line, ",\"peer\":{}", r.peer);
        }
        let _ = writeln!(
            s.line,
            ",\"bytes\":{},\"algorithm\":\"{}\",\"state\":\"{}\",\"queued_us\":{}}}}},",
            r.bytes,
            Algorithm::name_of(fp.algo),
            r.state.name(),
            Us(r.started_ns.saturating_sub(r.issued_ns)),
        );
        for p in spans {
            // A phase lies inside its operation (clocks are read in order on one thread).
            let start = p.start_ns.clamp(r.started_ns, r.ended_ns);
            let end = p.end_ns.clamp(start, r.ended_ns);
            let _ = writeln!(
                s.line,
                "{{\"name\":\"{}\",\"cat\":\"phase\",\"ph\":\"X\",\"ts\":{},\"dur\":{},\"pid\":{pid},\"tid\":{tid},\"args\":{{\"seq\":{},\"bytes\":{}}}}},",
                p.phase.name(),
                Us(start),
                Us(end - start),
                fp.seq,
                p.bytes
            );
        }
        let Sink { out, line, .. } = s;
        let _ = out.write_all(line.as_bytes());
    }
}

/// The track of the program's own spans ([`span`]), beside the communicators' tracks.
const APP_TID: u32 = 1 << 20;
static APP_NAMED: std::sync::Once = std::sync::Once::new();

/// Adds a span of the program's own (`name` in category `cat`, from `start_ns` to `end_ns`, ns
/// since the Unix epoch as [`now_ns`] gives) to this process's timeline, on a track named
/// "application" beside its communicators'. Does nothing when no communicator of this process
/// writes a timeline (`TOROID_TIMELINE` unset, or before the first communicator exists), so a
/// program may call it unconditionally. The trainer marks its forward, backward and optimiser
/// passes with it.
pub fn span(cat: &str, name: &str, start_ns: u64, end_ns: u64) {
    let Some(Some(sink)) = SINK.get() else { return };
    let mut s = sink.lock().unwrap_or_else(|e| e.into_inner());
    let pid = s.pid;
    APP_NAMED.call_once(|| {
        let meta = format!(
            "{{\"name\":\"thread_name\",\"ph\":\"M\",\"ts\":0,\"pid\":{pid},\"tid\":{APP_TID},\"args\":{{\"name\":\"application\"}}}},\n"
        );
        let _ = s.out.write_all(meta.as_bytes());
    });
    let ev = format!(
        "{{\"name\":\"{}\",\"cat\":\"{}\",\"ph\":\"X\",\"ts\":{},\"dur\":{},\"pid\":{pid},\"tid\":{APP_TID},\"args\":{{}}}},\n",
        escape(name),
        escape(cat),
        Us(start_ns),
        Us(end_ns.saturating_sub(start_ns))
    );
    let _ = s.out.write_all(ev.as_bytes());
}

/// Now, in ns since the Unix epoch (the clock of every timeline event).
pub fn now_ns() -> u64 {
    super::now_ns()
}

/// `s` as the inside of a JSON string.
fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out
}

/// Flushes this process's timeline file (the program may call it before it exits; dropping a
/// communicator does it too).
pub fn flush() {
    if let Some(Some(sink)) = SINK.get() {
        let _ = sink.lock().unwrap_or_else(|e| e.into_inner()).out.flush();
    }
}

/// Merges the rank files of the timeline at `path` (ranks `0..n`, those that exist) into one
/// trace at `path` (`{"traceEvents": [...]}`), removing them. Returns the events merged.
pub fn merge(path: &Path, n: usize) -> std::io::Result<usize> {
    let mut out = BufWriter::new(File::create(path)?);
    out.write_all(b"{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n")?;
    let mut events = 0usize;
    for r in 0..n {
        let file = rank_file(path, r);
        let Ok(text) = std::fs::read_to_string(&file) else { continue };
        for line in text.lines() {
            let ev = line.trim().trim_end_matches(',');
            if ev.is_empty() || ev == "[" {
                continue;
            }
            if events > 0 {
                out.write_all(b",\n")?;
            }
            out.write_all(ev.as_bytes())?;
            events += 1;
        }
        let _ = std::fs::remove_file(&file);
    }
    out.write_all(b"\n]}\n")?;
    out.flush()?;
    Ok(events)
}
