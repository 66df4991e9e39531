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

fn us(ns: u64) -> String {
    format!("{}.{:03}", ns / 1000, ns % 1000)
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
        let dur = r.ended_ns.saturating_sub(r.started_ns);
        let root = if fp.root >= 0 { format!(",\"root\":{}", fp.root) } else { String::new() };
        let peer = if r.peer >= 0 { format!(",\"peer\":{}", r.peer) } else { String::new() };
        let op = if matches!(fp.kind, CollKind::AllReduce | CollKind::ReduceScatter | CollKind::Reduce) {
            format!(",\"op\":\"{:?}\"", fp.op)
        } else {
            String::new()
        };
        let _ = writeln!(
            s.line,
            "{{\"name\":\"{}\",\"cat\":\"collective\",\"ph\":\"X\",\"ts\":{},\"dur\":{},\"pid\":{pid},\"tid\":{tid},\
             \"args\":{{\"seq\":{},\"count\":{},\"dtype\":\"{}\"{op}{root}{peer},\"bytes\":{},\"algorithm\":\"{}\",\"state\":\"{}\",\"queued_us\":{}}}}},",
            fp.kind.name(),
            us(r.started_ns),
            us(dur),
            fp.seq,
            fp.count,
            fp.dtype,
            r.bytes,
            Algorithm::name_of(fp.algo),
            r.state.name(),
            us(r.started_ns.saturating_sub(r.issued_ns)),
        );
        for p in spans {
            // A phase lies inside its operation (clocks are read in order on one thread).
            let start = p.start_ns.clamp(r.started_ns, r.ended_ns);
            let end = p.end_ns.clamp(start, r.ended_ns);
            let _ = writeln!(
                s.line,
                "{{\"name\":\"{}\",\"cat\":\"phase\",\"ph\":\"X\",\"ts\":{},\"dur\":{},\"pid\":{pid},\"tid\":{tid},\"args\":{{\"seq\":{},\"bytes\":{}}}}},",
                p.phase.name(),
                us(start),
                us(end - start),
                fp.seq,
                p.bytes
            );
        }
        let Sink { out, line, .. } = s;
        let _ = out.write_all(line.as_bytes());
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
