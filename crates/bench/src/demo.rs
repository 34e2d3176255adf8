//! `memtide demo`: the built-in workload, first all in DRAM and then under memtide with a
//! DRAM budget a fraction of its footprint, with live progress and the results side by side.
//! Also holds [`run_workload`], which `bench` uses for every configuration. Entry point:
//! [`demo`].

use std::io::{BufRead, BufReader, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use memtide_engine::launch::{die_with_parent, Settings, StatsDir};
use memtide_engine::{size::format as bytes, Snapshot};

use crate::workload::{Line, WorkloadArgs, WorkloadResult};
use crate::{opts, preflight, summary};

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Memory the workload touches.
    #[arg(long, value_parser = opts::nonzero_size, default_value = "2GiB")]
    pub footprint: u64,
    /// DRAM budget under memtide.
    #[arg(long, value_parser = opts::nonzero_size, default_value = "512MiB")]
    pub dram: u64,
    /// Where tier 1 lives (a directory).
    #[arg(long, default_value = "/var/tmp")]
    pub tier: PathBuf,
    /// Seconds of random accesses in each configuration.
    #[arg(long, value_parser = opts::seconds, default_value = "10")]
    pub seconds: f64,
    /// Fraction of pages in the hot set.
    #[arg(long, value_parser = opts::fraction, default_value = "10%")]
    pub hot: f64,
    /// Fraction of accesses that go to the hot set. The rest go anywhere, so under memtide
    /// most of them are tier-1 reads: the default sends 1 in 100,000 there (the active set
    /// fits in DRAM); 99% shows what touching cold memory often costs.
    #[arg(long, value_parser = opts::fraction, default_value = "99.999%")]
    pub hot_share: f64,
    /// Seconds of accesses before measuring (the hot set moves into DRAM meanwhile).
    #[arg(long, value_parser = opts::seconds_or_zero, default_value = "10")]
    pub warmup: f64,
    /// Fraction of accesses that are writes.
    #[arg(long, value_parser = opts::fraction, default_value = "20%")]
    pub writes: f64,
    /// What the pages hold: `2x` (the default: half random bytes, so they compress about 2:1,
    /// as much program data does), `3x`, `text`, `random` (incompressible) or `zero-heavy`
    /// (almost all zero: flatters any compressor).
    #[arg(long, value_enum, default_value = "2x")]
    pub contents: crate::workload::Contents,
    /// How memtide keeps pages that leave DRAM: `lz4` (compressed into a pool within the DRAM
    /// budget first), `zstd` (the same pool, compressed with zstd) or `off` (straight to tier
    /// 1).
    #[arg(long, value_parser = opts::compress, default_value = "lz4")]
    pub compress: memtide_engine::Compress,
}

/// How a workload run is placed.
pub enum Placement<'a> {
    /// No limit: everything in DRAM.
    Dram,
    /// Under memtide with this DRAM budget and tier directory.
    Memtide {
        dram: u64,
        tier: &'a Path,
        preload: &'a Path,
        faults: memtide_engine::Delivery,
        policy: memtide_engine::EvictionPolicy,
        compress: memtide_engine::Compress,
        /// The pool's share of `dram` (`--compressed-max`), or its default.
        pool_share: Option<f64>,
    },
    /// In a memory cgroup limited to `limit` (Linux swap does the tiering): the pid is written
    /// to `procs` before the workload starts.
    Cgroup { procs: &'a Path },
}

impl Placement<'_> {
    /// Sets `cmd` up to run in this placement; memtide's statistics go to `stats_dir`.
    pub fn apply(&self, cmd: &mut Command, stats_dir: &Path) {
        match self {
            Placement::Dram => {}
            Placement::Memtide {
                dram,
                tier,
                preload,
                faults,
                policy,
                compress,
                pool_share,
            } => Settings {
                stats_dir: Some(stats_dir.to_path_buf()),
                stats_interval_ms: 500,
                faults: *faults,
                policy: *policy,
                compress: *compress,
                compressed_max: pool_share.map(|s| (*dram as f64 * s) as u64 / 4096 * 4096),
                ..Settings::new(*dram, *tier)
            }
            .apply(preload, cmd),
            Placement::Cgroup { procs } => {
                memtide_engine::launch::join_cgroup_at_start(cmd, procs.to_path_buf());
            }
        }
    }
}

/// What one workload run produced.
pub struct Outcome {
    pub result: WorkloadResult,
    /// Peak resident set of the workload process (from the kernel).
    pub peak_rss: u64,
    pub memtide: Option<Snapshot>,
    pub wall_seconds: f64,
}

/// Runs the built-in workload in a child process, showing progress on stderr under `label`.
pub fn run_workload(label: &str, w: &WorkloadArgs, place: &Placement) -> Result<Outcome> {
    run_workload_showing(label, w, place, true)
}

/// [`run_workload`] with the progress lines on or off (off when several run at once).
pub fn run_workload_showing(
    label: &str,
    w: &WorkloadArgs,
    place: &Placement,
    show: bool,
) -> Result<Outcome> {
    let exe = std::env::current_exe().context("cannot locate the memtide binary")?;
    let mut cmd = Command::new(exe);
    cmd.args(w.to_args())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let stats_dir = StatsDir::new().context("cannot create a directory for the statistics")?;
    place.apply(&mut cmd, &stats_dir.0);
    // A workload never outlives the demo or bench that started it, however that ends.
    die_with_parent(&mut cmd, libc::SIGKILL);
    let start = Instant::now();
    let mut child = cmd.spawn().context("cannot start the workload")?;
    let out = child.stdout.take().expect("piped stdout");
    let tty = show && std::io::stderr().is_terminal();
    let mut result = None;
    let mut last_print = Instant::now();
    for line in BufReader::new(out).lines() {
        let line = line.context("reading the workload's output")?;
        match serde_json::from_str::<Line>(&line) {
            Ok(Line::Progress {
                phase,
                elapsed,
                done,
                accesses,
            }) => {
                let msg = if phase == "fill" {
                    format!("{label}: first touch {:>3.0}%", done * 100.0)
                } else if phase == "warmup" {
                    format!(
                        "{label}: warming up {:>4.1}/{:.0} s, {:>6.0} k accesses/s",
                        elapsed,
                        w.warmup,
                        accesses as f64 / elapsed.max(1e-9) / 1e3
                    )
                } else {
                    format!(
                        "{label}: running {:>4.1}/{:.0} s, {:>6.0} k accesses/s",
                        elapsed,
                        w.seconds,
                        accesses as f64 / elapsed.max(1e-9) / 1e3
                    )
                };
                if tty {
                    eprint!("\r\x1b[2K{msg}");
                    let _ = std::io::stderr().flush();
                } else if show && last_print.elapsed().as_secs_f64() > 2.0 {
                    last_print = Instant::now();
                    eprintln!("{msg}");
                }
            }
            Ok(Line::Result(r)) => result = Some(r),
            Err(_) => {}
        }
    }
    let (status, used) = memtide_engine::sys::wait_child(child.id())?;
    if tty {
        eprint!("\r\x1b[2K");
    }
    let wall_seconds = start.elapsed().as_secs_f64();
    let Some(result) = result else {
        bail!("{label}: the workload ended without a result (status {status:#x})");
    };
    if result.mismatches > 0 {
        bail!(
            "{label}: DATA MISMATCH in {} of {} pages",
            result.mismatches,
            result.verified_pages
        );
    }
    let memtide = summary::collect(&stats_dir.0)
        .main()
        .map(|(s, _)| s.clone());
    Ok(Outcome {
        result,
        peak_rss: used.peak_rss,
        memtide,
        wall_seconds,
    })
}

pub fn demo(a: DemoArgs) -> Result<ExitCode> {
    preflight::check_dram(a.dram)?;
    if a.footprint > preflight::machine_memory() / 2 {
        bail!(
            "--footprint {} is more than half this machine's memory; the all-DRAM run needs it all in DRAM",
            bytes(a.footprint)
        );
    }
    preflight::check_tier(&a.tier, None)?;
    preflight::check_uffd()?;
    let preload = preflight::find_preload()?;
    let w = WorkloadArgs {
        footprint: a.footprint,
        hot: a.hot,
        hot_share: a.hot_share,
        writes: a.writes,
        seconds: a.seconds,
        warmup: a.warmup,
        threads: 1,
        rate: 0.0,
        scan: false,
        contents: a.contents,
        seed: 42,
    };
    let pct = a.dram as f64 * 100.0 / a.footprint as f64;
    eprintln!(
        "memtide demo: {} footprint, {:.0}% of pages hot taking {}% of accesses, {:.0}% writes",
        bytes(a.footprint),
        a.hot * 100.0,
        format!("{:.3}", a.hot_share * 100.0)
            .trim_end_matches('0')
            .trim_end_matches('.'),
        a.writes * 100.0
    );
    eprintln!(
        "  1) all in DRAM   2) memtide with {} of DRAM ({pct:.0}% of the footprint), tier 1 in {}",
        bytes(a.dram),
        a.tier.display()
    );
    let dram = run_workload("all-DRAM", &w, &Placement::Dram)?;
    eprintln!("all-DRAM: {:.0} k accesses/s", dram.result.throughput / 1e3);
    let mt = run_workload(
        "memtide",
        &w,
        &Placement::Memtide {
            dram: a.dram,
            tier: &a.tier,
            preload: &preload,
            faults: memtide_engine::Delivery::Threads,
            policy: memtide_engine::EvictionPolicy::default(),
            compress: a.compress,
            pool_share: None,
        },
    )?;
    eprintln!("memtide: {:.0} k accesses/s", mt.result.throughput / 1e3);
    let s = mt.memtide.clone().unwrap_or_default();
    let ratio = mt.result.throughput / dram.result.throughput;
    let rows: Vec<(&str, String, String)> = vec![
        (
            "throughput",
            format!("{:.0} k/s", dram.result.throughput / 1e3),
            format!("{:.0} k/s  ({ratio:.2}x)", mt.result.throughput / 1e3),
        ),
        (
            "first touch of footprint",
            format!("{:.2} s", dram.result.fill_seconds),
            format!(
                "{:.2} s  ({:.2}x)",
                mt.result.fill_seconds,
                mt.result.fill_seconds / dram.result.fill_seconds
            ),
        ),
        (
            "DRAM used (peak)",
            bytes(dram.peak_rss),
            format!(
                "{} managed + {} other",
                bytes(s.peak_dram_bytes),
                bytes(mt.peak_rss.saturating_sub(s.peak_dram_bytes))
            ),
        ),
        (
            "compressed pool holds",
            "-".into(),
            format!(
                "{} of pages in {} of DRAM",
                bytes(s.compressed_pages * 4096),
                bytes(s.compressed_pool_bytes)
            ),
        ),
        ("tier 1 holds", "-".into(), bytes(s.tier_bytes)),
        (
            "slow accesses (>20 µs)",
            format!("{:.2}%", dram.result.slow_fraction * 100.0),
            format!("{:.2}%", mt.result.slow_fraction * 100.0),
        ),
        (
            "faults from the pool",
            "-".into(),
            format!(
                "{}  (p50 {:.0} µs, p99 {:.0} µs)",
                s.faults_compressed,
                s.fault_compressed_latency_p50_us,
                s.fault_compressed_latency_p99_us
            ),
        ),
        (
            "tier-1 faults",
            "-".into(),
            format!(
                "{}  (p50 {:.0} µs, p99 {:.0} µs)",
                s.faults_tier - s.faults_compressed.min(s.faults_tier),
                s.fault_tier_latency_p50_us,
                s.fault_tier_latency_p99_us
            ),
        ),
        (
            "pages verified",
            format!("{} ok", dram.result.verified_pages),
            format!("{} ok", mt.result.verified_pages),
        ),
    ];
    println!();
    println!(
        "{:<26} {:<16} memtide, DRAM {}",
        "",
        "all-DRAM",
        bytes(a.dram)
    );
    for (k, d, m) in rows {
        println!("{k:<26} {d:<16} {m}");
    }
    println!();
    println!(
        "memtide kept {:.0}% of all-DRAM throughput with {:.0}% of the footprint in DRAM.",
        ratio * 100.0,
        pct
    );
    if ratio > 1.05 {
        println!(
            "(More than all-DRAM is not a speed-up memtide can promise: in a virtual machine a hot set packed into fewer pages can run faster than the same pages scattered over the whole footprint. Read it as no loss.)"
        );
    }
    println!(
        "Each access to a page in the compressed pool waits for a decompression ({:.0} µs here), one in tier 1 for a read ({:.0} µs): try --hot-share 99% to send 1 in 100 accesses to cold memory.",
        s.fault_compressed_latency_p50_us, s.fault_tier_latency_p50_us
    );
    Ok(ExitCode::SUCCESS)
}
