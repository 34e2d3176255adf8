//! `memtide probe PATH`: is the device under PATH fit to be a memory tier? Measures 4 KiB random
//! read latency at queue depth 1, random read IOPS at depths 1/8/32, random write IOPS and
//! sequential bandwidth on an O_DIRECT test file, judges the read latency by the published
//! operator guidance, measures how long waking a sleeping thread takes on the same CPU and
//! on another (what a fault served by handler threads pays), and writes JSON that `sim` and
//! `plan` read. Entry point: [`probe`].

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use crate::device::{Pattern, ProbeFile, Run};
use anyhow::{Context, Result};
use clap::Args;
use memtide_engine::size;
use memtide_policy::health::{Health, HealthThresholds};
use serde::{Deserialize, Serialize};

/// What memtide adds to a tier-1 read on a fault (fault delivery, mapping), measured on these
/// machines as tier fault p50 minus raw O_DIRECT read p50 (BENCHMARKS.md).
pub const FAULT_OVERHEAD_US: f64 = 8.0;

#[derive(Args, Debug)]
pub struct ProbeArgs {
    /// A directory on the device to judge (a test file is created there and removed).
    pub path: PathBuf,
    /// About 5 seconds instead of about 30 (less precise).
    #[arg(long)]
    pub quick: bool,
    /// Size of the test file (default 1GiB, 256MiB with --quick). Larger than the device's
    /// cache gives more honest figures.
    #[arg(long, value_parser = crate::opts::nonzero_size)]
    pub size: Option<u64>,
    /// Also write the results as JSON to this file (read by `sim --probe` and `plan --probe`).
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Keep the test file (its path is in the report) to run other tools on the same file.
    #[arg(long, hide = true)]
    pub keep_file: bool,
}

/// Latency percentiles and rate of one run.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Latency {
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub iops: f64,
}

/// The probe's findings, as written with `--json`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ProbeReport {
    pub path: String,
    pub test_file: String,
    pub size_bytes: u64,
    /// `io_uring`, or `pread` (threads) where io_uring is unavailable.
    pub io: String,
    /// 4 KiB random reads, one at a time.
    pub read_qd1: Latency,
    pub read_iops_qd8: f64,
    pub read_iops_qd32: f64,
    /// 4 KiB random writes, 32 in flight.
    pub write_iops_qd32: f64,
    /// 1 MiB sequential transfers, 4 in flight.
    pub seq_read_bytes_per_sec: f64,
    pub seq_write_bytes_per_sec: f64,
    /// Colour of the QD1 read latency p50 by the operator guidance.
    pub verdict: String,
    /// What a tier-1 miss costs under memtide on this device: read p50 plus fault overhead.
    pub tier_latency_us: f64,
    /// Faults per second one faulting thread can be served at that latency, and all threads
    /// together (bounded by the device's QD32 read rate).
    pub fault_rate_per_thread: f64,
    pub fault_rate_max: f64,
    /// Waking a sleeping thread, p50 µs: on the waker's CPU and on another CPU (absent with
    /// one CPU). A fault served by a handler thread wakes threads like this.
    #[serde(default)]
    pub wake_same_cpu_us: Option<f64>,
    #[serde(default)]
    pub wake_other_cpu_us: Option<f64>,
}

impl ProbeReport {
    /// Reads a report written by `memtide probe --json`.
    pub fn load(path: &Path) -> Result<ProbeReport> {
        let data = std::fs::read(path)
            .with_context(|| format!("cannot read probe results {}", path.display()))?;
        serde_json::from_slice(&data).map_err(|e| {
            anyhow::anyhow!(
                "{} is not a `memtide probe --json` result: {e}",
                path.display()
            )
        })
    }
}

fn percentile(sorted: &[u64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i] as f64 / 1e3
}

fn latency(run: &mut Run) -> Latency {
    run.latencies_ns.sort_unstable();
    Latency {
        p50_us: percentile(&run.latencies_ns, 0.50),
        p99_us: percentile(&run.latencies_ns, 0.99),
        p999_us: percentile(&run.latencies_ns, 0.999),
        iops: run.iops(),
    }
}

fn rate(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.2} M", v / 1e6)
    } else if v >= 1e3 {
        format!("{:.1} K", v / 1e3)
    } else {
        format!("{v:.0} ")
    }
}

fn bandwidth(bps: f64) -> String {
    if bps >= 1e9 {
        format!("{:.2} GB/s", bps / 1e9)
    } else {
        format!("{:.0} MB/s", bps / 1e6)
    }
}

pub fn probe(a: ProbeArgs) -> Result<ExitCode> {
    let size = a
        .size
        .unwrap_or(if a.quick { 256 << 20 } else { 1 << 30 })
        .max(16 << 20);
    let file = ProbeFile::create(&a.path, size, a.keep_file)?;
    let io = if file.uses_io_uring() {
        "io_uring"
    } else {
        "pread"
    };
    eprintln!(
        "memtide probe {}: {} test file, O_DIRECT, {io}{}",
        a.path.display(),
        size::format(size),
        if a.quick { ", quick" } else { "" }
    );
    if !file.uses_io_uring() {
        eprintln!("memtide: io_uring is unavailable here; measuring with pread/pwrite from threads (memtide would use the same fallback)");
    }
    // Stage lengths: the whole probe is about 30 s (5 s quick) plus the first write pass.
    let scale = if a.quick { 0.17 } else { 1.0 };
    let secs = |s: f64| Duration::from_secs_f64(s * scale);
    let tty = std::io::stderr().is_terminal();
    let stages = 6;
    let show = |stage: usize, name: &str, f: f64| {
        if tty {
            let total = (stage as f64 + f.clamp(0.0, 1.0)) / stages as f64;
            let w = 30;
            let filled = (total * w as f64) as usize;
            eprint!(
                "\r[{}{}] {name:<28}",
                "#".repeat(filled),
                " ".repeat(w - filled.min(w))
            );
            let _ = std::io::stderr().flush();
        }
    };
    let step = |stage: usize, name: &str, pattern, depth, block, d: Duration| -> Result<Run> {
        show(stage, name, 0.0);
        file.run(pattern, depth, block, d, &|f| show(stage, name, f))
            .with_context(|| format!("{name} on {}", a.path.display()))
    };
    // The first pass writes the whole file, so that reads hit written blocks (reads of
    // unwritten blocks never reach the device); it is the sequential write figure.
    let seq_write = step(
        0,
        "sequential write",
        Pattern::SequentialWrite,
        4,
        1 << 20,
        Duration::from_secs(600),
    )?;
    let mut qd1 = step(
        1,
        "random read, QD1",
        Pattern::RandomRead,
        1,
        4096,
        secs(10.0),
    )?;
    let qd8 = step(
        2,
        "random read, QD8",
        Pattern::RandomRead,
        8,
        4096,
        secs(4.0),
    )?;
    let qd32 = step(
        3,
        "random read, QD32",
        Pattern::RandomRead,
        32,
        4096,
        secs(5.0),
    )?;
    let wr = step(
        4,
        "random write, QD32",
        Pattern::RandomWrite,
        32,
        4096,
        secs(4.0),
    )?;
    let seq_read = step(
        5,
        "sequential read",
        Pattern::SequentialRead,
        4,
        1 << 20,
        secs(4.0),
    )?;
    if tty {
        eprintln!("\r{:<70}", "");
    }
    let read = latency(&mut qd1);
    let guidance = HealthThresholds::default();
    let verdict = Health::of_latency(read.p50_us, &guidance);
    let tail = Health::of_latency(read.p99_us, &guidance);
    let tier_latency_us = read.p50_us + FAULT_OVERHEAD_US;
    let wake = wake_up_us();
    let report = ProbeReport {
        path: a.path.display().to_string(),
        test_file: file.path().display().to_string(),
        size_bytes: size,
        io: io.into(),
        read_qd1: read.clone(),
        read_iops_qd8: qd8.iops(),
        read_iops_qd32: qd32.iops(),
        write_iops_qd32: wr.iops(),
        seq_read_bytes_per_sec: seq_read.bytes_per_sec(),
        seq_write_bytes_per_sec: seq_write.bytes_per_sec(),
        verdict: verdict.as_str().into(),
        tier_latency_us,
        fault_rate_per_thread: 1e6 / tier_latency_us,
        fault_rate_max: qd32.iops(),
        wake_same_cpu_us: wake.map(|w| w.0),
        wake_other_cpu_us: wake.map(|w| w.1),
    };
    println!(
        "4 KiB random read, QD1    p50 {:.0} µs   p99 {:.0} µs   p99.9 {:.0} µs   {}IOPS",
        read.p50_us,
        read.p99_us,
        read.p999_us,
        rate(read.iops)
    );
    println!(
        "4 KiB random read, QD8    {}IOPS",
        rate(report.read_iops_qd8)
    );
    println!(
        "4 KiB random read, QD32   {}IOPS",
        rate(report.read_iops_qd32)
    );
    println!(
        "4 KiB random write, QD32  {}IOPS",
        rate(report.write_iops_qd32)
    );
    println!(
        "sequential read, 1 MiB    {}",
        bandwidth(report.seq_read_bytes_per_sec)
    );
    println!(
        "sequential write, 1 MiB   {}",
        bandwidth(report.seq_write_bytes_per_sec)
    );
    println!(
        "verdict: {} — tier-1 read latency p50 {:.0} µs (guidance: green under {:.0} µs, yellow {:.0}–{:.0} µs, red over {:.0} µs){}",
        verdict.as_str().to_uppercase(),
        read.p50_us,
        guidance.latency_yellow_us,
        guidance.latency_yellow_us,
        guidance.latency_red_us,
        guidance.latency_red_us,
        if tail > verdict {
            format!("; p99 {:.0} µs is {}", read.p99_us, tail.as_str())
        } else {
            String::new()
        }
    );
    println!(
        "page faults it can serve: about {}/s per faulting thread (a miss costs ~{:.0} µs: the read plus ~{FAULT_OVERHEAD_US:.0} µs of fault handling), up to {}/s with many threads faulting at once",
        rate(report.fault_rate_per_thread),
        tier_latency_us,
        rate(report.fault_rate_max)
    );
    if let Some((same, other)) = wake {
        println!(
            "waking a thread           p50 {same:.1} µs on the same CPU, {other:.1} µs on another{}",
            if other > SLOW_WAKE_US && other > 4.0 * same {
                " — slow: idle CPUs halt without polling (as on a VM), and each fault served by \
                 handler threads (the default) wakes every CPU's handler; the guest's halt polling \
                 (guest_halt_poll_ns) or `--faults signal` avoids that (docs/notebook/2026-11-25-10-placement-engine.md)"
            } else {
                ""
            }
        );
    }
    if let Some(p) = &a.json {
        crate::report::write_json(p, &serde_json::to_value(&report)?)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// A wake-up across CPUs slower than this (and than 4x one on the same CPU) is called slow.
const SLOW_WAKE_US: f64 = 10.0;

/// The p50 time to wake a sleeping thread, on the waker's CPU and on another one: half the
/// round trip of two threads pinned to those CPUs handing a turn back and forth, each sleeping
/// until it is woken (a futex, through `park`). None with a single CPU.
fn wake_up_us() -> Option<(f64, f64)> {
    let cpus = memtide_engine::threads::allowed_cpus().ok()?;
    if cpus.len() < 2 {
        return None;
    }
    let same = ping_pong(cpus[0], cpus[0])?;
    let other = ping_pong(cpus[0], cpus[1])?;
    Some((same, other))
}

/// Half the p50 round trip of a turn handed between threads pinned to CPUs `a` and `b`.
fn ping_pong(a: usize, b: usize) -> Option<f64> {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;
    const ROUNDS: usize = 600;
    // Measured from a thread of its own pinned to `a`, so the caller's affinity is kept.
    let measure = std::thread::spawn(move || {
        // Best effort: unpinned, the figure is only less exact.
        let _ = memtide_engine::threads::pin_to_cpu(a);
        let turn = Arc::new(AtomicU32::new(0));
        let me = std::thread::current();
        let peer = {
            let turn = Arc::clone(&turn);
            std::thread::spawn(move || {
                let _ = memtide_engine::threads::pin_to_cpu(b);
                for _ in 0..ROUNDS {
                    while turn.load(Ordering::Acquire) != 1 {
                        std::thread::park();
                    }
                    turn.store(0, Ordering::Release);
                    me.unpark();
                }
            })
        };
        let mut ns = Vec::with_capacity(ROUNDS);
        for _ in 0..ROUNDS {
            let t0 = std::time::Instant::now();
            turn.store(1, Ordering::Release);
            peer.thread().unpark();
            while turn.load(Ordering::Acquire) != 0 {
                std::thread::park();
            }
            ns.push(t0.elapsed().as_nanos() as u64);
        }
        let _ = peer.join();
        ns
    });
    let mut ns = measure.join().ok()?;
    ns.sort_unstable();
    Some(percentile(&ns, 0.5) / 2.0)
}
