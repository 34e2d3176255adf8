//! `memtide run`: starts a program with the preload library and its settings, forwards
//! signals to it, keeps the `--stats` file current, prints the summary when it exits, and
//! exits with the program's status. Under a host daemon (`--host`) it registers the program as
//! a tenant, reports its figures every interval and passes the quota it gets back on to the
//! program's engine; with `--metrics` it serves the program's figures to Prometheus. Entry
//! point: [`run`].

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, ExitStatus};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;

use memtide_engine::launch::{self, die_with_parent, forward_signals, Settings, StatsDir};
use memtide_host::client::default_socket;
use memtide_host::protocol::{HostStatus, Registration, TenantReport, TenantStatus};

use memtide_launch::host_link::{pinned_report, HostLink};
use memtide_launch::{opts, preflight, summary};

#[derive(Args, Debug)]
pub struct RunArgs {
    /// DRAM the program's managed memory may use (e.g. 512MiB, 4GiB), together with every
    /// process it forks or starts; the rest goes to tier 1.
    /// Under --host: the DRAM the daemon guarantees it (its minimum; default 64MiB).
    #[arg(long, value_parser = opts::nonzero_size, required_unless_present = "host")]
    pub dram: Option<u64>,
    /// Where tier 1 lives: a directory to create the tier file in, or a file name to create.
    /// The file is removed when the program exits. [default: /var/tmp, or the host daemon's]
    #[arg(long)]
    pub tier: Option<PathBuf>,
    /// Most bytes tier 1 may hold (default: as much as the program's managed memory needs;
    /// with --host, the tenant's share of the host's tier capacity, which this caps).
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
    /// access to an evicted page fails unless memtide wrapped the call). See docs/design.md,
    /// "Fault delivery".
    #[arg(long, value_parser = opts::delivery, default_value = "threads")]
    pub faults: memtide_engine::Delivery,
    /// Which pages leave DRAM: `sweep` (a CLOCK sweep over pages idle for the most epochs;
    /// the default; `clock` is an older name) or `placement` (new pages on probation in a
    /// small FIFO queue, pages used again in a SIEVE queue; misses less on skewed workloads and
    /// keeps a hot set through a scan, at the cost of more hint faults). `memtide sim --policy`
    /// replays each under the same name (there, `clock` is the classic CLOCK, not the sweep).
    #[arg(long, value_parser = opts::eviction_policy, default_value = "sweep")]
    pub policy: memtide_engine::EvictionPolicy,
    /// How pages leaving DRAM are kept: `lz4` (the default: compressed into a pool in DRAM,
    /// within --dram, before any goes to tier 1; a fault on a page in the pool is a
    /// decompression, no I/O), `zstd` (the same pool, compressed with zstd: text-like data
    /// takes about 40% less room than under lz4, at up to 2x the CPU to compress and 3.5x to
    /// decompress) or `off`
    /// (straight to tier 1). See README, "Levels".
    #[arg(long, value_parser = opts::compress, default_value = "lz4")]
    pub compress: memtide_engine::Compress,
    /// The compressed pool's size within --dram (default: a sixteenth of it), or with
    /// `--compressed-sizing adaptive` the most it may grow to (default: half of --dram). At
    /// most three quarters of --dram are used: the rest holds the pages in use.
    #[arg(long, value_parser = opts::nonzero_size, value_name = "SIZE")]
    pub compressed_max: Option<u64>,
    /// How the compressed pool is sized: `fixed` (the default: --compressed-max, or a
    /// sixteenth of --dram) or `adaptive` (from a sixteenth, a step of a thirty-second of
    /// --dram up while what a step more pool would have saved in file faults outweighs what
    /// the step of DRAM costs the pages in use, down when it does not; measured, it does not
    /// yet beat the fixed sixteenth: README, "Levels").
    #[arg(long, value_parser = opts::pool_sizing, default_value = "fixed", value_name = "HOW")]
    pub compressed_sizing: opts::PoolSizing,
    /// Make the program a tenant of the host daemon (`memtide host`) at this socket (default
    /// /run/memtide/host.sock, or MEMTIDE_HOST_SOCKET): its DRAM quota then follows the host's
    /// split, at least --dram. If the daemon goes away, the program keeps its last quota and
    /// registers again when the daemon is back.
    #[arg(long, num_args = 0..=1, require_equals = true, value_name = "SOCKET")]
    pub host: Option<Option<PathBuf>>,
    /// The tenant's name in `memtide status` and in metrics (default: the program's name).
    #[arg(long)]
    pub name: Option<String>,
    /// Under --host: the most DRAM the daemon may give the program.
    #[arg(long, value_parser = opts::nonzero_size, requires = "host")]
    pub max: Option<u64>,
    /// Under --host: never tier this program (a latency-sensitive tenant): it runs without
    /// memtide, and the daemon reserves --dram of the host's DRAM for it.
    #[arg(long, requires = "host")]
    pub pinned: bool,
    /// Serve the program's figures as Prometheus metrics at http://ADDR/metrics (e.g.
    /// 127.0.0.1:9465).
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<std::net::SocketAddr>,
    /// Encrypt pages before they leave DRAM (AES-256-GCM with a key made for this run that
    /// lives only in memory): tier 1 holds no plaintext, and a page altered there is refused
    /// (the program is stopped) rather than served. Under a host daemon started with
    /// --encrypt-tier this is on for every tenant.
    #[arg(long)]
    pub encrypt_tier: bool,
    /// Record what the engine sees — every page brought into DRAM (first touches, tier faults,
    /// hint faults) with its time — and write it as a trace (.mtt) when the program exits, for
    /// `memtide sim --trace FILE` to answer "what if this program had X DRAM".
    #[arg(long, value_name = "FILE")]
    pub record: Option<PathBuf>,
    /// Print no summary at exit, and of memtide's messages only fatal ones.
    #[arg(long, short)]
    pub quiet: bool,
    /// Write memtide's own words once the program has started (its warnings, those from inside
    /// the program's processes, the summary) to FILE, appended, instead of memtide's stderr.
    /// The program's streams are its own either way.
    #[arg(long, value_name = "FILE")]
    pub log: Option<PathBuf>,
    /// The program and its arguments (after `--`).
    #[arg(required = true, trailing_var_arg = true, value_name = "PROGRAM")]
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

/// What the launcher knows of its tenant while the program runs (for --metrics and status).
#[derive(Default)]
struct View {
    report: TenantReport,
    quota: u64,
    tenant: u64,
}

/// A note of memtide's before the program starts: to the log if there is one (memtide's
/// stderr goes there once the program runs), else to stderr.
fn note(log: Option<&std::fs::File>, line: &str) {
    match log {
        Some(mut f) => {
            use std::io::Write;
            let _ = writeln!(f, "{line}");
        }
        None => eprintln!("{line}"),
    }
}

pub fn run(a: RunArgs) -> Result<ExitCode> {
    let program = &a.command[0];
    // Opened first: a log that cannot be written ends here, before anything else happens.
    let log = match &a.log {
        Some(p) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .with_context(|| format!("cannot open the log {}", p.display()))?,
        ),
        None => None,
    };
    let name = a.name.clone().unwrap_or_else(|| {
        Path::new(program)
            .file_name()
            .map_or_else(|| program.clone(), |n| n.to_string_lossy().into_owned())
    });
    // Under a host daemon: register first (a refusal ends here, before the program starts).
    let (mut link, grant) = match a
        .host
        .as_ref()
        .map(|s| s.clone().unwrap_or_else(default_socket))
    {
        Some(socket) => {
            let reg = Registration {
                name: name.clone(),
                pid: std::process::id(),
                min_bytes: a.dram.unwrap_or(64 << 20),
                max_bytes: a.max,
                pinned: a.pinned,
            };
            let (link, grant) = HostLink::register(&socket, reg)?;
            // The program reports every --stats-interval: twice within the daemon's patience.
            let patience = grant.silence_seconds;
            if patience > 0.0 && a.stats_interval > patience / 2.0 {
                bail!(
                    "--stats-interval {}s: the host daemon lets go of a tenant that sends no report for {patience}s; give at most {}s",
                    a.stats_interval,
                    patience / 2.0
                );
            }
            (Some(link), Some(grant))
        }
        None => (None, None),
    };
    let dram = match (&link, a.dram) {
        (Some(l), _) => l.quota(),
        (None, Some(d)) => d,
        (None, None) => bail!("give --dram (or --host)"),
    };
    let tier = a
        .tier
        .clone()
        .or_else(|| grant.as_ref().map(|g| PathBuf::from(&g.tier_dir)))
        .unwrap_or_else(|| PathBuf::from("/var/tmp"));
    // Under a daemon the tier's size is the tenant's share of the host's capacity and follows
    // it (never above --tier-size, if given); the engine may grow it up to the capacity.
    let own_tier = a.tier_size;
    let tier_of = move |share: u64| own_tier.map_or(share, |o| o.min(share));
    let sharing_tier = grant.as_ref().is_some_and(|g| g.tier_capacity_bytes > 0);
    let (tier_size, tier_max) = match &grant {
        Some(g) if sharing_tier => (
            Some(tier_of(g.tier_bytes)),
            Some(tier_of(g.tier_capacity_bytes)),
        ),
        // A daemon that does not share its tier: what it granted, fixed.
        Some(g) => (a.tier_size.or(Some(g.tier_bytes).filter(|&b| b > 0)), None),
        None => (a.tier_size, None),
    };
    let encrypt_tier = a.encrypt_tier || grant.as_ref().is_some_and(|g| g.encrypt_tier);
    if a.compressed_sizing == opts::PoolSizing::Adaptive
        && a.compress == memtide_engine::Compress::Off
    {
        bail!("--compressed-sizing adaptive sizes the compressed pool, which --compress off turns off");
    }
    if let Some(m) = a.compressed_max {
        if m >= dram {
            bail!(
                "--compressed-max {}: the pool lives within the DRAM quota ({}); give less",
                memtide_engine::size::format(m),
                memtide_engine::size::format(dram)
            );
        }
    }
    let pinned = a.pinned;
    let ready = if pinned {
        None
    } else {
        let ready = preflight::check(dram, &tier, tier_size, program)?;
        if ready.buffered_tier {
            note(
                log.as_ref(),
                &format!(
                    "memtide: note: {} has no O_DIRECT; tier 1 will use buffered I/O",
                    tier.display()
                ),
            );
        }
        Some(ready)
    };
    if let Some(p) = &a.stats {
        // Fail now, not after the program ran.
        std::fs::write(p, b"{}\n")
            .with_context(|| format!("cannot write --stats file {}", p.display()))?;
    }
    if let Some(p) = &a.record {
        if pinned {
            bail!("--record needs a tiered program (a --pinned one runs without memtide)");
        }
        std::fs::File::create(p)
            .with_context(|| format!("cannot write --record file {}", p.display()))?;
    }
    let view = Arc::new(Mutex::new(View {
        quota: dram,
        tenant: link.as_ref().map_or(0, |l| l.tenant()),
        ..View::default()
    }));
    if let Some(addr) = a.metrics {
        let view = view.clone();
        let name = name.clone();
        let bound = memtide_host::metrics::serve_http(
            addr,
            memtide_host::metrics::Routes {
                status: Box::new(move || {
                    let v = view.lock().unwrap_or_else(|e| e.into_inner());
                    single_tenant_status(&name, &v)
                }),
                history: None,
            },
        )?;
        note(
            log.as_ref(),
            &format!("memtide: metrics at http://{bound}/metrics"),
        );
    }
    let mut stats_dir = StatsDir::new().context("cannot create a directory for the statistics")?;
    let interval_ms = (a.stats_interval * 1000.0).max(50.0) as u64;
    let mut cmd = Command::new(program);
    cmd.args(&a.command[1..]);
    if let Some(ready) = &ready {
        Settings {
            tier_size,
            tier_max,
            min_bytes: a.min_bytes,
            stats_dir: Some(stats_dir.0.clone()),
            stats_interval_ms: interval_ms,
            faults: a.faults,
            policy: a.policy,
            encrypt_tier,
            compress: a.compress,
            compressed_max: a.compressed_max,
            compressed_adaptive: a.compressed_sizing == opts::PoolSizing::Adaptive,
            record: a.record.is_some(),
            ..Settings::new(dram, &tier)
        }
        .apply(&ready.preload, &mut cmd);
    }
    // If memtide itself is killed, the program is told to stop (as by a hang-up) rather than
    // run on unwatched.
    die_with_parent(&mut cmd, libc::SIGTERM);
    let mut child = cmd
        .spawn()
        .with_context(|| format!("cannot start {program}"))?;
    if let Some(f) = &log {
        // The program has the stderr it was given; from here on memtide's own goes to the log.
        launch::stderr_to(f).context("cannot send memtide's messages to the log")?;
    }
    let child_pid = child.id();
    forward_signals(child_pid);
    let done = Arc::new(AtomicBool::new(false));
    // What memtide says from inside the program's processes, printed here (never into the
    // program's own stderr).
    let relay = Arc::new(Mutex::new(memtide_engine::say::Relay::new(&stats_dir.0)));
    let quiet = a.quiet;
    // Poll the stats files while the program runs: for --stats, and so that the summary can
    // judge coverage at peak rather than after the program freed its memory. Under a host
    // daemon, report to it and pass its quota on.
    let poller = {
        let done = done.clone();
        let dir = stats_dir.0.clone();
        let program = program.clone();
        let path = a.stats.clone();
        let view = view.clone();
        let mut link = link.take();
        let relay = relay.clone();
        std::thread::spawn(move || {
            let mut c = summary::Collected::default();
            let mut asked = dram;
            let mut asked_tier = tier_size.unwrap_or(0);
            while !done.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(interval_ms));
                relay.lock().unwrap_or_else(|e| e.into_inner()).relay(quiet);
                c.update(&dir);
                if let Some(p) = &path {
                    write_stats_file(p, &program, None, &c);
                }
                let mut report = if pinned {
                    pinned_report(child_pid)
                } else {
                    TenantReport::of(c.latest.values(), memtide_launch::procs::running)
                };
                report.pid = child_pid;
                let (quota, share) = match &mut link {
                    Some(l) => l.report(&report),
                    None => (asked, asked_tier),
                };
                if quota != asked && !pinned && launch::ask_quota(&dir, quota).is_ok() {
                    asked = quota;
                }
                let tier = tier_of(share);
                if sharing_tier
                    && tier != asked_tier
                    && !pinned
                    && launch::ask_tier_size(&dir, tier).is_ok()
                {
                    asked_tier = tier;
                }
                let mut v = view.lock().unwrap_or_else(|e| e.into_inner());
                v.report = report;
                v.quota = quota;
                if let Some(l) = &link {
                    v.tenant = l.tenant();
                }
            }
            c
        })
    };
    let status = child.wait().context("waiting for the program")?;
    done.store(true, Ordering::Release);
    let mut c = poller.join().unwrap_or_default();
    c.update(&stats_dir.0);
    let fatal = {
        let mut r = relay.lock().unwrap_or_else(|e| e.into_inner());
        r.relay(a.quiet);
        r.fatal.first().cloned()
    };
    // Said once: not again when the directory goes (a process that outlives the program and
    // says more after this is not heard).
    stats_dir.relayed();
    if let Some(p) = &a.stats {
        write_stats_file(p, program, Some(status), &c);
    }
    if let Some(p) = &a.record {
        let (events, dropped) = write_trace(&stats_dir.0, p)
            .with_context(|| format!("cannot write the recording to {}", p.display()))?;
        eprintln!(
            "memtide: recorded {events} pages brought into DRAM to {}{}; replay: memtide sim --trace {} --dram SIZES --policy {}",
            p.display(),
            if dropped > 0 {
                format!(" ({dropped} more lost: the recording fell behind)")
            } else {
                String::new()
            },
            p.display(),
            a.policy.name()
        );
    }
    if !a.quiet && !pinned {
        use std::os::unix::process::ExitStatusExt;
        let how = match &fatal {
            // The figures stop where memtide stopped it: say so first.
            Some(line) if status.signal() == Some(libc::SIGABRT) => format!(
                "was stopped by memtide ({})",
                line.trim_start_matches("memtide: fatal: ")
            ),
            Some(line) => format!(
                "{}; a process of it was stopped by memtide ({})",
                describe(status),
                line.trim_start_matches("memtide: fatal: ")
            ),
            None => describe(status),
        };
        summary::print(program, &how, &c);
    }
    Ok(ExitCode::from(exit_code(status)))
}

/// Turns the raw recordings in `dir` (one per process) into one `.mtt` trace at `to`, each
/// process a tenant, in time order. Returns the events written and those the engines dropped.
fn write_trace(dir: &Path, to: &Path) -> Result<(u64, u64)> {
    use memtide_engine::Event;
    use memtide_sim::trace::{Level, Record, Writer};
    let mut files: Vec<(u32, PathBuf)> = std::fs::read_dir(dir)?
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let pid = name
                .strip_prefix(launch::RECORD_PREFIX)?
                .strip_suffix(".raw")?
                .parse()
                .ok()?;
            Some((pid, e.path()))
        })
        .collect();
    files.sort();
    let mut events: Vec<(Record, Level)> = Vec::new();
    for (tenant, (_, path)) in files.iter().enumerate() {
        let raw = std::fs::read(path)?;
        let decoded: Vec<(u64, u64, u64)> = raw
            .chunks_exact(16)
            .map(|rec| {
                let time = u64::from_le_bytes(rec[..8].try_into().expect("8 bytes"));
                let word = u64::from_le_bytes(rec[8..].try_into().expect("8 bytes"));
                let kind = word & ((1 << Event::BITS) - 1);
                (time, word >> Event::BITS, kind)
            })
            .collect();
        // A page first touched again was freed or discarded in between: to the simulator,
        // which has no "free", it is a new page (a fresh number past every page the process
        // used), not a miss on the old one.
        let mut next = decoded.iter().map(|e| e.1 + 1).max().unwrap_or(0);
        let mut name: std::collections::HashMap<u64, u64> = std::collections::HashMap::new();
        for (time, page, kind) in decoded {
            let first = kind == Event::FirstTouch as u64;
            let level = match kind {
                k if k == Event::TierFault as u64 => Level::File,
                k if k == Event::PoolFault as u64 => Level::Pool,
                _ => Level::Dram,
            };
            let id = match name.get(&page) {
                Some(_) if first => {
                    next += 1;
                    name.insert(page, next - 1);
                    next - 1
                }
                Some(&id) => id,
                None => {
                    name.insert(page, page);
                    page
                }
            };
            events.push((
                Record {
                    time_ns: time,
                    tenant: tenant as u32,
                    page: id,
                    write: false,
                },
                level,
            ));
        }
    }
    events.sort_by_key(|r| r.0.time_ns);
    let collected = summary::collect(dir);
    let dropped: u64 = collected.latest.values().map(|s| s.recorded_dropped).sum();
    let mut w = Writer::recording(
        std::io::BufWriter::new(std::fs::File::create(to)?),
        memtide_policy::PAGE_SIZE as u32,
        pool_figures(&collected),
    )?;
    for &(r, level) in &events {
        w.record_at(r, level)?;
    }
    w.finish()?;
    Ok((events.len() as u64, dropped))
}

/// What the run's compressed pool measured, for its trace: the pages it held per page of its
/// DRAM (over every process, as they ended, or at their peak if their pools were empty by
/// then) and the median pool fault of the process that took the most. `None` without a pool.
fn pool_figures(c: &summary::Collected) -> Option<memtide_sim::PoolFigures> {
    let held = |m: &std::collections::BTreeMap<u32, memtide_engine::Snapshot>| {
        m.values().fold((0u64, 0u64), |(p, b), s| {
            (p + s.compressed_pages, b + s.compressed_pool_bytes)
        })
    };
    let (pages, bytes) = match held(&c.latest) {
        (_, 0) => held(&c.at_peak),
        h => h,
    };
    if bytes == 0 {
        return None;
    }
    let fault_us = c
        .latest
        .values()
        .max_by_key(|s| s.faults_compressed)
        .filter(|s| s.faults_compressed > 0)
        .map_or(0.0, |s| s.fault_compressed_latency_p50_us);
    Some(memtide_sim::PoolFigures {
        ratio: (pages * memtide_policy::PAGE_SIZE as u64) as f64 / bytes as f64,
        fault_ns: fault_us * 1e3,
    })
}

/// The status a single `memtide run --metrics` serves: the program as the only tenant, its
/// quota as the budget.
fn single_tenant_status(name: &str, v: &View) -> HostStatus {
    let t = TenantStatus {
        tenant: v.tenant,
        name: name.to_string(),
        pid: v.report.pid,
        quota_bytes: v.quota,
        tier_share_bytes: v.report.tier_limit_bytes,
        min_bytes: v.quota,
        active_pct: v.report.active_bytes as f64 * 100.0 / v.quota.max(1) as f64,
        report: v.report.clone(),
        ..TenantStatus::default()
    };
    HostStatus {
        budget_bytes: v.quota,
        quota_bytes: v.quota,
        dram_bytes: v.report.dram_bytes,
        tier_bytes: v.report.tier_bytes,
        tier_capacity_bytes: v.report.tier_limit_bytes,
        active_bytes: v.report.active_bytes,
        tier_read_latency_p50_us: v.report.tier_read_latency_p50_us,
        tier_read_latency_p99_us: v.report.tier_read_latency_p99_us,
        tenants: vec![t],
        ..HostStatus::default()
    }
}
