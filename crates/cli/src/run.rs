//! `memtide run`: starts a program with the preload library and its settings, forwards
//! signals to it, keeps the `--stats` file current, prints the summary when it exits, and
//! exits with the program's status. Entry point: [`run`].

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, ExitStatus};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;

use memtide_engine::launch::{die_with_parent, forward_signals, StatsDir, TierEnv};

use memtide_bench::{opts, preflight, summary};

#[derive(Args, Debug)]
pub struct RunArgs {
    /// DRAM the program's managed memory may use (e.g. 512MiB, 4GiB); the rest goes to tier 1.
    #[arg(long, value_parser = opts::nonzero_size)]
    pub dram: u64,
    /// Where tier 1 lives: a directory to create the tier file in, or a file name to create.
    /// The file is removed when the program exits.
    #[arg(long, default_value = "/var/tmp")]
    pub tier: PathBuf,
    /// Most bytes tier 1 may hold (default: as much as the program's managed memory needs).
    #[arg(long, value_parser = opts::nonzero_size)]
    pub tier_size: Option<u64>,
    /// Allocations at or above this size are managed (malloc family and anonymous mmap).
    #[arg(long, value_parser = opts::nonzero_size, default_value = "128KiB")]
    pub min_bytes: u64,
    /// Write the program's memtide statistics as JSON to this file, every --stats-interval
    /// and at exit.
    #[arg(long)]
    pub stats: Option<PathBuf>,
    /// How often to refresh --stats (e.g. 1s, 500ms).
    #[arg(long, value_parser = opts::seconds, default_value = "1s")]
    pub stats_interval: f64,
    /// How faults in managed memory are served: `threads` (handler threads, one per CPU;
    /// system calls, io_uring and other kernel accesses to managed memory wait for the page)
    /// or `signal` (in the faulting thread, from SIGBUS: no handler threads, but a kernel
    /// access to an evicted page fails unless memtide wrapped the call). See README, "How it
    /// works".
    #[arg(long, value_parser = opts::delivery, default_value = "threads")]
    pub faults: memtide_engine::Delivery,
    /// Print no summary at exit.
    #[arg(long, short)]
    pub quiet: bool,
    /// The program and its arguments (after `--`).
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "PROGRAM"
    )]
    pub command: Vec<String>,
}

/// Exit code a shell would report for this status.
pub fn exit_code(status: ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => c as u8,
        (None, Some(sig)) => 128u8.wrapping_add(sig as u8),
        _ => 1,
    }
}

pub fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exited with status {c}"),
        (None, Some(sig)) => format!("was killed by signal {sig}"),
        _ => "ended".into(),
    }
}

fn write_stats_file(
    path: &Path,
    program: &str,
    status: Option<ExitStatus>,
    c: &summary::Collected,
) {
    let json = serde_json::json!({
        "program": program,
        "exit_code": status.map(exit_code),
        "main_pid": c.main().map(|(s, _)| s.pid),
        "coverage": c.main().map(|(_, p)| summary::coverage(p)),
        "processes": c.latest.values().collect::<Vec<_>>(),
    });
    let tmp = path.with_extension("tmp");
    if std::fs::write(&tmp, serde_json::to_vec_pretty(&json).unwrap_or_default()).is_ok() {
        let _ = std::fs::rename(&tmp, path);
    }
}

pub fn run(a: RunArgs) -> Result<ExitCode> {
    let program = &a.command[0];
    let ready = preflight::check(a.dram, &a.tier, a.tier_size, program)?;
    if ready.buffered_tier {
        eprintln!(
            "memtide: note: {} has no O_DIRECT; tier 1 will use buffered I/O",
            a.tier.display()
        );
    }
    if let Some(p) = &a.stats {
        // Fail now, not after the program ran.
        std::fs::write(p, b"{}\n")
            .with_context(|| format!("cannot write --stats file {}", p.display()))?;
    }
    let stats_dir = StatsDir::new().context("cannot create a directory for the statistics")?;
    let interval_ms = (a.stats_interval * 1000.0).max(50.0) as u64;
    let mut cmd = Command::new(program);
    cmd.args(&a.command[1..]);
    TierEnv {
        preload: &ready.preload,
        dram: a.dram,
        tier: &a.tier,
        tier_size: a.tier_size,
        min_bytes: a.min_bytes,
        stats_dir: &stats_dir.0,
        stats_interval_ms: interval_ms,
        faults: a.faults,
    }
    .apply(&mut cmd);
    // If memtide itself is killed, the program is told to stop (as by a hang-up) rather than
    // run on unwatched.
    die_with_parent(&mut cmd, libc::SIGTERM);
    let mut child = cmd
        .spawn()
        .with_context(|| format!("cannot start {program}"))?;
    forward_signals(child.id());
    let done = Arc::new(AtomicBool::new(false));
    // Poll the stats files while the program runs: for --stats, and so that the summary can
    // judge coverage at peak rather than after the program freed its memory.
    let poller = {
        let done = done.clone();
        let dir = stats_dir.0.clone();
        let program = program.clone();
        let path = a.stats.clone();
        std::thread::spawn(move || {
            let mut c = summary::Collected::default();
            while !done.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(interval_ms));
                c.update(&dir);
                if let Some(p) = &path {
                    write_stats_file(p, &program, None, &c);
                }
            }
            c
        })
    };
    let status = child.wait().context("waiting for the program")?;
    done.store(true, Ordering::Release);
    let mut c = poller.join().unwrap_or_default();
    c.update(&stats_dir.0);
    if let Some(p) = &a.stats {
        write_stats_file(p, program, Some(status), &c);
    }
    if !a.quiet {
        summary::print(program, &describe(status), &c);
    }
    Ok(ExitCode::from(exit_code(status)))
}
