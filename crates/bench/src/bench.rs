//! `memtide bench`: the built-in workload under every configuration side by side in one run —
//! all-DRAM, memtide at each DRAM budget, Linux swap at the same budgets (a memory cgroup
//! limited to the budget and a swap file on the tier's filesystem, zswap off) — with
//! interleaved repetitions, medians and ratios; plus two microbenchmarks (first-touch fill,
//! tier-1 fault latency against a raw O_DIRECT read of the same device). Every system setting
//! it changes is put back when it ends, however it ends. Entry point: [`bench`].

use std::io::{BufRead, Write};

use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::device::{Pattern, ProbeFile};
use anyhow::{bail, Context, Result};
use clap::Args;
use memtide_engine::size::format as bytes;
use memtide_engine::sys;
use serde::{Deserialize, Serialize};

use crate::demo::{run_workload, Outcome, Placement};
use crate::report::{median, step_label};
use crate::workload::WorkloadArgs;
use crate::{opts, preflight};

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Experiments to run: `micro` (the built-in workload), `memcached` and `redis` (a
    /// dataset of --footprint bytes of values, zipf-distributed keys, 90% gets and 10% sets,
    /// over loopback from memtide's own load generator), `density` (how many tenants fit in
    /// --host-dram while each keeps 90% / 95% of its all-DRAM throughput), `noisy` (a tenant
    /// beside one streaming over a large cold footprint, each with its own budget), `vms` (how many QEMU guests of 1 GiB, each serving a paced load, fit in --vm-dram while
    /// each keeps 90% / 95% of its all-DRAM throughput) and `quotas` (four tenants with
    /// different active sets share --host-dram: an equal static split against the host
    /// daemon's activeness quotas).
    #[arg(long, value_delimiter = ',', default_value = "micro")]
    pub experiments: Vec<String>,
    /// Memory each workload run touches (for memcached and redis: bytes of values stored).
    #[arg(long, value_parser = opts::nonzero_size, default_value = "2GiB")]
    pub footprint: u64,
    /// Key popularity skews (zipf) for memcached and redis.
    #[arg(long, value_delimiter = ',', default_value = "0.99,0.8")]
    pub skews: Vec<f64>,
    /// Client connections driving memcached and redis.
    #[arg(long, default_value_t = 4)]
    pub clients: usize,
    /// Bytes per value for memcached and redis.
    #[arg(long, default_value_t = 4000)]
    pub value_bytes: usize,
    /// DRAM budgets, as percentages of the footprint (over 100: more DRAM than the workload
    /// touches, which measures memtide's overhead without pressure).
    #[arg(long, value_delimiter = ',', value_parser = opts::budget_percent, default_value = "75,50,25")]
    pub budgets: Vec<f64>,
    /// Workloads: `green` (10% of pages take all accesses but 1 in 100,000, which go
    /// anywhere: the active set is at most half of every budget down to 20%), `skewed` (10% of
    /// pages take 99% and the other 1% go anywhere: every page is touched every few seconds,
    /// so the active set is the whole footprint), `red` (80% of pages take 99%: the active
    /// set is larger than DRAM), `hotcold` (a scattered 20% of pages take 90%: at 50% the hot
    /// set fits and what placement keeps decides the misses; not in the default set) and
    /// `uniform`.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "green,skewed,red,uniform"
    )]
    pub workloads: Vec<String>,
    /// Worker threads of the workload; every count is run.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    pub threads: Vec<usize>,
    /// Density: the DRAM the tenants share (split evenly among them under memtide and Linux
    /// swap; all-DRAM fits as many tenants as this holds). Quotas: the host daemon's budget
    /// (and four times each tenant's static share).
    #[arg(long, value_parser = opts::nonzero_size, default_value = "512MiB")]
    pub host_dram: u64,
    /// Density and quotas: memory each tenant touches; noisy: the sensitive tenant's.
    #[arg(long, value_parser = opts::nonzero_size, default_value = "256MiB")]
    pub tenant_footprint: u64,
    /// Density: the numbers of tenants to try.
    #[arg(long, value_delimiter = ',', default_value = "2,4,8,12,16,18,20")]
    pub tenants: Vec<usize>,
    /// Density: the load each tenant serves, in accesses/s (the green workload, paced).
    #[arg(long, value_parser = opts::rate, default_value = "100K/s")]
    pub tenant_rate: f64,
    /// VMs: the DRAM the guests share (split evenly among them under memtide and Linux swap;
    /// all-DRAM fits as many 1 GiB guests as this holds).
    #[arg(long, value_parser = opts::nonzero_size, default_value = "2GiB")]
    pub vm_dram: u64,
    /// VMs: the numbers of guests to try.
    #[arg(long, value_delimiter = ',', default_value = "4,5,6,7")]
    pub guests: Vec<usize>,
    /// VMs: the load each guest serves, in accesses/s (a TCG guest on one CPU manages about
    /// 3M/s, so the default leaves room for many guests per CPU).
    #[arg(long, value_parser = opts::rate, default_value = "200K/s")]
    pub guest_rate: f64,
    /// VMs: seconds each guest serves its load before measuring (after booting and filling
    /// its memory; the part it touches most must come back from tier 1 or swap first).
    #[arg(long, value_parser = opts::seconds_or_zero, default_value = "15")]
    pub guest_warmup: f64,
    /// VMs: seconds measured per guest.
    #[arg(long, value_parser = opts::seconds, default_value = "10")]
    pub guest_seconds: f64,
    /// VMs: directory with the test guest's vmlinuz and initramfs (from vm/build-guest.sh;
    /// default: target/guest beside the memtide binary, built there on first use).
    #[arg(long)]
    pub guest: Option<PathBuf>,
    /// Noisy: memory the streaming neighbour sweeps over.
    #[arg(long, value_parser = opts::nonzero_size, default_value = "2GiB")]
    pub neighbour_footprint: u64,
    /// Noisy: each tenant's DRAM budget, as a percentage of the sensitive tenant's footprint.
    #[arg(long, value_parser = opts::percent, default_value = "50")]
    pub tenant_dram: f64,
    /// How memtide's configurations get their faults: `threads` (handler threads, the
    /// default), `signal` (SIGBUS in the faulting thread), or both (`threads,signal`: every
    /// memtide configuration twice, the SIGBUS one marked `sig`).
    #[arg(long, value_delimiter = ',', value_parser = opts::delivery, default_value = "threads")]
    pub faults: Vec<memtide_engine::Delivery>,
    /// Which pages memtide's configurations evict: `clock` (the default), `placement`, or both
    /// (`clock,placement`: every memtide configuration twice, the placement one marked
    /// `placement`). See `memtide run --policy`.
    #[arg(long, value_delimiter = ',', value_parser = opts::eviction_policy, default_value = "clock")]
    pub policy: Vec<memtide_engine::EvictionPolicy>,
    /// Directory for memtide's tier file and Linux's swap file (the same device for both).
    #[arg(long, default_value = "/var/tmp")]
    pub tier: PathBuf,
    /// Seconds measured per run.
    #[arg(long, value_parser = opts::seconds, default_value = "5")]
    pub seconds: f64,
    /// Seconds of warm-up per run before measuring.
    #[arg(long, value_parser = opts::seconds_or_zero, default_value = "5")]
    pub warmup: f64,
    /// Repetitions of every configuration (interleaved); medians are reported. Default 3, and
    /// 2 for `vms`, whose runs take about a minute each.
    #[arg(long = "reps")]
    pub reps_given: Option<usize>,
    /// Skip the Linux-swap and zswap configurations (they need root).
    #[arg(long)]
    pub no_swap: bool,
    /// Skip the zswap configurations (Linux swap with a compressed RAM cache in front).
    #[arg(long)]
    pub no_zswap: bool,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Plots, one SVG per workload: throughput against all-DRAM per DRAM budget, written to
    /// PREFIX-WORKLOAD.svg.
    #[arg(long, default_value = "memtide-bench")]
    pub plot: PathBuf,
}

impl BenchArgs {
    /// Repetitions of every configuration but the VM experiment's.
    pub fn reps(&self) -> usize {
        self.reps_given.unwrap_or(3)
    }

    /// Repetitions of the VM experiment's configurations.
    pub fn guest_reps(&self) -> usize {
        self.reps_given.unwrap_or(2)
    }
}

/// A workload of the microbenchmark: which share of pages gets which share of accesses.
pub fn workload_shape(name: &str) -> Option<(f64, f64)> {
    match name {
        "green" => Some((0.10, 0.99999)),
        "skewed" => Some((0.10, 0.99)),
        "red" => Some((0.80, 0.99)),
        "hotcold" => Some((0.20, 0.90)),
        "uniform" => Some((1.0, 1.0)),
        _ => None,
    }
}

const ZSWAP: &str = "/sys/module/zswap/parameters/enabled";

/// Turns zswap on (for a zswap configuration) or off (for plain Linux swap).
pub fn set_zswap(on: bool) -> Result<()> {
    std::fs::write(ZSWAP, if on { "Y" } else { "N" }).context("cannot switch zswap")
}

/// Whether the user interrupted the bench (it then stops and restores every setting).
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::Relaxed)
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_interrupt(_: i32) {
    INTERRUPTED.store(true, Ordering::Relaxed);
}

/// A setting the bench changed.
#[derive(Serialize, Deserialize, Debug)]
enum Restore {
    /// A swap file it switched on: off and removed.
    Swapfile(PathBuf),
    /// A cgroup it created: its processes killed, then removed.
    Cgroup(PathBuf),
    /// A file it wrote: the old value written back.
    Write(PathBuf, String),
}

impl Restore {
    fn undo(&self) {
        match self {
            Restore::Swapfile(p) => {
                if p.exists() {
                    for _ in 0..10 {
                        let off = Command::new("swapoff").arg(p).output();
                        if off.is_ok_and(|o| o.status.success())
                            || !std::fs::read_to_string("/proc/swaps")
                                .is_ok_and(|s| s.contains(&*p.to_string_lossy()))
                        {
                            break;
                        }
                        std::thread::sleep(Duration::from_millis(200));
                    }
                    let _ = std::fs::remove_file(p);
                }
            }
            Restore::Cgroup(p) => {
                // Normally empty by now; after a killed bench, its runs may still be inside.
                let t0 = Instant::now();
                while p.exists() && std::fs::remove_dir(p).is_err() {
                    if t0.elapsed() > Duration::from_secs(10) {
                        break;
                    }
                    for pid in std::fs::read_to_string(p.join("cgroup.procs"))
                        .unwrap_or_default()
                        .lines()
                    {
                        if let Ok(pid) = pid.trim().parse::<u32>() {
                            let _ = sys::kill(pid, libc::SIGKILL);
                        }
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
            Restore::Write(p, v) => {
                let _ = std::fs::write(p, v);
            }
        }
    }
}

/// The settings the bench changed, put back when it ends; and, while it runs, a janitor: a
/// process of its own that puts them back if the bench dies without doing so (killed with
/// SIGKILL, or a crash). The bench tells the janitor of each setting before changing it, over
/// a pipe; when the pipe closes without the bench's "done", the janitor restores them.
struct Guard {
    changed: Vec<Restore>,
    janitor: Option<(Child, ChildStdin)>,
}

impl Guard {
    /// A guard, with a janitor when `janitor` (settings of the whole system will change).
    fn new(janitor: bool) -> Result<Guard> {
        let janitor = if janitor {
            let exe = std::env::current_exe().context("cannot locate the memtide binary")?;
            let mut child = Command::new(exe)
                .arg("bench-janitor")
                .stdin(Stdio::piped())
                .spawn()
                .context("cannot start the bench's janitor")?;
            let stdin = child.stdin.take().expect("piped stdin");
            Some((child, stdin))
        } else {
            None
        };
        Ok(Guard {
            changed: Vec::new(),
            janitor,
        })
    }

    /// Records a setting about to change (before changing it: a change half made is undone
    /// too).
    fn push(&mut self, r: Restore) -> Result<()> {
        if let Some((_, pipe)) = &mut self.janitor {
            let line = serde_json::to_string(&r)?;
            writeln!(pipe, "{line}").context("cannot reach the bench's janitor")?;
        }
        self.changed.push(r);
        Ok(())
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        for r in self.changed.drain(..).rev() {
            r.undo();
        }
        if let Some((mut child, mut pipe)) = self.janitor.take() {
            let _ = writeln!(pipe, "done");
            drop(pipe);
            let _ = child.wait();
        }
    }
}

/// The janitor's side (`memtide bench-janitor`, started by the bench): reads the settings the
/// bench changes from stdin and, if stdin closes without "done", puts them back.
pub fn janitor() -> Result<ExitCode> {
    // A session of its own, deaf to the terminal: Ctrl-C and hang-ups go to the bench, which
    // restores everything itself and says so.
    sys::new_session();
    for sig in [
        libc::SIGINT,
        libc::SIGHUP,
        libc::SIGTERM,
        libc::SIGQUIT,
        libc::SIGPIPE,
    ] {
        sys::set_signal_handler(sig, libc::SIG_IGN);
    }
    let mut pending = Vec::new();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        if line == "done" {
            return Ok(ExitCode::SUCCESS);
        }
        if let Ok(r) = serde_json::from_str::<Restore>(&line) {
            pending.push(r);
        }
    }
    let _ = writeln!(
        std::io::stderr(),
        "memtide: the bench stopped without putting back what it changed; restoring it"
    );
    for r in pending.iter().rev() {
        r.undo();
    }
    Ok(ExitCode::SUCCESS)
}

/// A DRAM budget of `pct`% of `footprint`, in whole MiB.
pub fn budget_bytes(footprint: u64, pct: f64) -> u64 {
    ((footprint as f64 * pct / 100.0) as u64).next_multiple_of(1 << 20)
}

pub use memtide_launch::summary::beyond_quota;

/// Gives Linux swap the same DRAM memtide had. memtide's quota counts only the memory it
/// manages; what the program keeps resident beyond that (small allocations, stacks, memtide's
/// own state) is DRAM too, and a memory cgroup counts all of it. So before each Linux-swap run
/// its cgroup's limit is set to the budget plus the most memory memtide's runs at that budget
/// so far kept beyond their quota; the limits are printed under the table.
pub struct SameDram {
    footprint: u64,
    /// The cgroups' limit file (`memory.max` or `memory.limit_in_bytes`); none without swap.
    limit_file: Option<&'static str>,
    /// Per budget (a fraction of the footprint): the most memtide kept beyond its quota.
    unmanaged: Vec<(f64, u64)>,
    /// Per Linux-swap configuration: its budget and the highest limit it ran under.
    limits: Vec<(String, u64, u64)>,
}

impl SameDram {
    pub fn new(a: &BenchArgs, configs: &Configs) -> SameDram {
        SameDram {
            footprint: a.footprint,
            limit_file: configs.1,
            unmanaged: Vec::new(),
            limits: Vec::new(),
        }
    }

    /// Before a run of configuration `name` at `budget` in `place`: a Linux-swap run gets its
    /// limit (returned); others nothing.
    pub fn before(&mut self, name: &str, budget: f64, place: &Placement) -> Result<Option<u64>> {
        let (Placement::Cgroup { procs }, Some(file)) = (place, self.limit_file) else {
            return Ok(None);
        };
        let dir = procs
            .parent()
            .context("a cgroup's procs file has a directory")?;
        let beyond = self
            .unmanaged
            .iter()
            .find(|(b, _)| *b == budget)
            .map_or(0, |&(_, most)| most);
        let budget = budget_bytes(self.footprint, budget * 100.0);
        let limit = budget + beyond.next_multiple_of(1 << 20);
        std::fs::write(dir.join(file), limit.to_string())
            .with_context(|| format!("cannot set the memory limit of {}", dir.display()))?;
        match self.limits.iter_mut().find(|l| l.0 == name) {
            Some(l) => l.2 = l.2.max(limit),
            None => self.limits.push((name.to_string(), budget, limit)),
        }
        Ok(Some(limit))
    }

    /// A memtide run at `budget` kept `bytes` beyond its quota (see [`beyond_quota`]).
    pub fn saw(&mut self, budget: f64, bytes: u64) {
        match self.unmanaged.iter_mut().find(|(b, _)| *b == budget) {
            Some((_, most)) => *most = (*most).max(bytes),
            None => self.unmanaged.push((budget, bytes)),
        }
    }

    /// Says what DRAM each Linux-swap configuration had.
    pub fn print(&self) {
        for (name, budget, limit) in &self.limits {
            println!(
                "({name}: cgroup limit up to {}, the budget of {} plus the most anonymous memory memtide's runs at that budget kept beyond their quota, so that both have the same DRAM)",
                memtide_engine::size::format(*limit),
                memtide_engine::size::format(*budget),
            );
        }
    }
}

/// Memory cgroups for tenants run side by side (Linux swap's placement); each run sets the
/// limits it needs.
pub struct TenantCgroups {
    dirs: Vec<PathBuf>,
    limit_file: &'static str,
}

impl TenantCgroups {
    /// Limits tenant `i`'s cgroup to `bytes`; returns the file that takes the tenant's pid.
    pub fn limit(&self, i: usize, bytes: u64) -> Result<PathBuf> {
        let dir = &self.dirs[i];
        std::fs::write(dir.join(self.limit_file), bytes.to_string())
            .with_context(|| format!("cannot set the memory limit of {}", dir.display()))?;
        Ok(dir.join("cgroup.procs"))
    }
}

/// Where the memory controller is and how to limit a cgroup.
struct MemCgroup {
    dir: PathBuf,
    limit_file: &'static str,
}

fn find_memory_cgroup() -> Result<MemCgroup> {
    let v2 = Path::new("/sys/fs/cgroup/cgroup.controllers");
    if std::fs::read_to_string(v2).is_ok_and(|c| c.split_whitespace().any(|x| x == "memory")) {
        return Ok(MemCgroup {
            dir: PathBuf::from("/sys/fs/cgroup"),
            limit_file: "memory.max",
        });
    }
    let v1 = Path::new("/sys/fs/cgroup/memory");
    if v1.join("memory.limit_in_bytes").exists() {
        return Ok(MemCgroup {
            dir: v1.to_path_buf(),
            limit_file: "memory.limit_in_bytes",
        });
    }
    bail!("no cgroup memory controller (v1 or v2) is mounted; run with --no-swap")
}

fn run_cmd(cmd: &mut Command, what: &str) -> Result<()> {
    let out = cmd.output().with_context(|| format!("cannot run {what}"))?;
    if !out.status.success() {
        bail!(
            "{what} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Sets up Linux swap: a swap file on the tier filesystem, zswap off, a cgroup per budget.
fn setup_swap(a: &BenchArgs, swap_bytes: u64, guard: &mut Guard) -> Result<MemCgroup> {
    if sys::effective_uid() != 0 {
        bail!("the Linux-swap configurations need root (swapon, cgroups); run as root or with --no-swap");
    }
    let cg = find_memory_cgroup()?;
    // zswap is switched per run (off for Linux swap, on for zswap) and put back afterwards.
    if let Ok(v) = std::fs::read_to_string(ZSWAP) {
        guard.push(Restore::Write(PathBuf::from(ZSWAP), v.trim().to_string()))?;
        std::fs::write(ZSWAP, "N").context("cannot turn zswap off")?;
    }
    let swap = a
        .tier
        .join(format!("memtide-bench-{}.swap", std::process::id()));
    guard.push(Restore::Swapfile(swap.clone()))?;
    let size = swap_bytes + (256 << 20);
    let f = std::fs::File::create(&swap)
        .with_context(|| format!("cannot create {}", swap.display()))?;
    // Swap files must be fully allocated.
    if sys::allocate(&f, size).is_err() {
        bail!(
            "cannot allocate a {} swap file in {}",
            bytes(size),
            a.tier.display()
        );
    }
    drop(f);
    std::fs::set_permissions(&swap, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    run_cmd(Command::new("mkswap").arg(&swap), "mkswap")?;
    run_cmd(Command::new("swapon").arg(&swap), "swapon")?;
    Ok(cg)
}

#[derive(Serialize, Clone, Default)]
struct RunRecord {
    workload: String,
    threads: usize,
    config: String,
    rep: usize,
    throughput: f64,
    fill_seconds: f64,
    slow_fraction: f64,
    /// p50 of the sampled slow accesses: a fault as the program waits for it.
    slow_p50_us: f64,
    peak_rss: u64,
    tier_fault_p50_us: Option<f64>,
    tier_read_p50_us: Option<f64>,
    peak_dram: Option<u64>,
    verified_pages: u64,
    /// Linux swap's cgroup limit: the budget plus what memtide's runs kept unmanaged.
    #[serde(skip_serializing_if = "Option::is_none")]
    cgroup_limit: Option<u64>,
    /// Why the run ended without a result (Linux configurations only).
    #[serde(skip_serializing_if = "Option::is_none")]
    failed: Option<String>,
}

#[derive(Serialize)]
struct Row {
    workload: String,
    threads: usize,
    config: String,
    /// DRAM budget as a fraction of the footprint (1 for all-DRAM).
    budget: f64,
    throughput_median: f64,
    vs_dram: f64,
    vs_swap: Option<f64>,
    fill_median_seconds: f64,
    slow_fraction_median: f64,
    slow_p50_median_us: f64,
}

/// p50 of random 4 KiB O_DIRECT reads at queue depth 1 on a file in `dir`, in µs (the
/// probe's measurement, shorter).
fn raw_read_p50_us(dir: &Path) -> Result<f64> {
    let file = ProbeFile::create(dir, 256 << 20, false)?;
    let d = std::time::Duration::from_secs(600);
    file.run(Pattern::SequentialWrite, 4, 1 << 20, d, &|_| {})?;
    let run = file.run(
        Pattern::RandomRead,
        1,
        4096,
        std::time::Duration::from_secs(3),
        &|_| {},
    )?;
    Ok(median(
        run.latencies_ns.iter().map(|&ns| ns as f64 / 1e3).collect(),
    ))
}

pub fn bench(a: BenchArgs) -> Result<ExitCode> {
    if a.reps_given == Some(0) {
        bail!("--reps must be at least 1");
    }
    for e in &a.experiments {
        if ![
            "micro",
            "memcached",
            "redis",
            "density",
            "noisy",
            "vms",
            "quotas",
        ]
        .contains(&e.as_str())
        {
            bail!("unknown experiment `{e}`: choose micro, memcached, redis, density, noisy, vms, quotas");
        }
        if ["memcached", "redis"].contains(&e.as_str()) {
            crate::kv::Server::from_name(e)
                .expect("known")
                .check_installed()?;
        }
    }
    if a.skews.iter().any(|s| !(*s > 0.0 && *s < 4.0)) {
        bail!("--skews: give zipf skews between 0 and 4, like 0.99,0.8");
    }
    if a.clients == 0 || a.clients > 256 {
        bail!("--clients: give 1 to 256 connections");
    }
    if !(16..=1 << 20).contains(&a.value_bytes) {
        bail!("--value-bytes: give 16 bytes to 1 MiB");
    }
    for w in &a.workloads {
        if workload_shape(w).is_none() {
            bail!("unknown workload `{w}`: choose green, skewed, red, hotcold, uniform");
        }
    }
    if a.threads.is_empty() || a.threads.iter().any(|&t| t == 0 || t > 64) {
        bail!("--threads: give thread counts from 1 to 64");
    }
    let has = |e: &str| a.experiments.iter().any(|x| x == e);
    if a.footprint > preflight::machine_memory() / 2 {
        bail!("--footprint {} is more than half this machine's memory; the all-DRAM runs need it all in DRAM", bytes(a.footprint));
    }
    let most_tenants = a.tenants.iter().copied().max().unwrap_or(0);
    if has("density") {
        if a.tenants.is_empty() || a.tenants.iter().any(|&n| n == 0 || n > 64) {
            bail!("--tenants: give numbers of tenants from 1 to 64, like 2,4,8");
        }
        if a.host_dram / (most_tenants as u64) < 1 << 20 {
            bail!(
                "--host-dram {} split among {most_tenants} tenants leaves less than 1 MiB each",
                bytes(a.host_dram)
            );
        }
        let all = a.tenant_footprint * most_tenants as u64;
        if all > preflight::machine_memory() / 2 {
            bail!("{most_tenants} tenants of {} need {} for the all-DRAM runs, more than half this machine's memory; lower --tenants or --tenant-footprint", bytes(a.tenant_footprint), bytes(all));
        }
    }
    if has("noisy") && a.tenant_footprint + a.neighbour_footprint > preflight::machine_memory() / 2
    {
        bail!("--tenant-footprint plus --neighbour-footprint is more than half this machine's memory; the all-DRAM runs need it all in DRAM");
    }
    let most_guests = a.guests.iter().copied().max().unwrap_or(0);
    if has("vms") {
        if a.guests.is_empty() || a.guests.iter().any(|&n| n == 0 || n > 64) {
            bail!("--guests: give numbers of guests from 1 to 64, like 2,4,8");
        }
        let least = crate::vms::least_share();
        if a.vm_dram / (most_guests as u64) < least {
            bail!(
                "--vm-dram {} split among {most_guests} guests leaves less than {} each (QEMU's own memory and some guest RAM)",
                bytes(a.vm_dram),
                bytes(least)
            );
        }
        let all = crate::vms::GUEST_RAM * most_guests as u64;
        if all > preflight::machine_memory() / 2 {
            bail!("{most_guests} guests of {} need {} for the all-DRAM runs, more than half this machine's memory; lower --guests", bytes(crate::vms::GUEST_RAM), bytes(all));
        }
    }
    // The most memory any one run puts in tier 1 or swap.
    let mut swap_bytes = 0;
    if has("micro") || has("memcached") || has("redis") {
        swap_bytes = a.footprint;
    }
    if has("density") {
        swap_bytes = swap_bytes.max(a.tenant_footprint * most_tenants as u64);
    }
    if has("noisy") {
        swap_bytes = swap_bytes.max(a.tenant_footprint + a.neighbour_footprint);
    }
    if has("vms") {
        swap_bytes = swap_bytes.max(crate::vms::GUEST_RAM * most_guests as u64);
    }
    let budgets: Vec<u64> = a
        .budgets
        .iter()
        .map(|&p| budget_bytes(a.footprint, p))
        .collect();
    for &b in &budgets {
        preflight::check_dram(b)?;
    }
    preflight::check_tier(&a.tier, Some(swap_bytes))?;
    preflight::check_uffd()?;
    let preload = preflight::find_preload()?;
    let guests = if has("vms") {
        Some(crate::vms::Guests::find(a.guest.as_deref())?)
    } else {
        None
    };
    // An async-signal-safe handler; children still get the terminal's SIGINT and stop, and we
    // clean up. A hang-up or a closed output pipe (whoever watched the bench went away) must
    // not kill it before it restores swap, zswap and cgroups: SIGHUP stops it like SIGINT,
    // and SIGPIPE is ignored (a write fails instead).
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        sys::set_signal_handler(sig, on_interrupt as *const () as libc::sighandler_t);
    }
    sys::set_signal_handler(libc::SIGPIPE, libc::SIG_IGN);
    let mut guard = Guard::new(!a.no_swap)?;
    let cg = if a.no_swap {
        None
    } else {
        Some(setup_swap(&a, swap_bytes, &mut guard)?)
    };
    // One cgroup per budget, created now so a failure stops us before any run.
    let mut cgroups = Vec::new();
    if let Some(cg) = &cg {
        for &b in &budgets {
            let dir = cg
                .dir
                .join(format!("memtide-bench-{}-{}", std::process::id(), b >> 20));
            guard.push(Restore::Cgroup(dir.clone()))?;
            std::fs::create_dir(&dir)
                .with_context(|| format!("cannot create cgroup {}", dir.display()))?;
            std::fs::write(dir.join(cg.limit_file), b.to_string())
                .with_context(|| format!("cannot set the memory limit of {}", dir.display()))?;
            cgroups.push(dir.join("cgroup.procs"));
        }
    }
    // One cgroup per tenant of the multi-tenant experiments; each run sets its limit.
    let tenant_cgroups = match &cg {
        Some(cg) if has("density") || has("noisy") || has("vms") => {
            let mut dirs = Vec::new();
            for i in 0..most_tenants.max(most_guests).max(2) {
                let dir = cg
                    .dir
                    .join(format!("memtide-bench-{}-tenant{i}", std::process::id()));
                guard.push(Restore::Cgroup(dir.clone()))?;
                std::fs::create_dir(&dir)
                    .with_context(|| format!("cannot create cgroup {}", dir.display()))?;
                dirs.push(dir);
            }
            Some(TenantCgroups {
                dirs,
                limit_file: cg.limit_file,
            })
        }
        _ => None,
    };

    let mut timing = Vec::new();
    let others = a.experiments.iter().any(|e| e != "vms");
    let reps = match (a.reps_given, others, has("vms")) {
        (Some(r), _, _) => r.to_string(),
        (None, true, true) => format!("{} (vms: {})", a.reps(), a.guest_reps()),
        (None, false, _) => a.guest_reps().to_string(),
        (None, true, false) => a.reps().to_string(),
    };
    if others {
        timing.push(format!("{:.0}+{:.0} s per run", a.warmup, a.seconds));
    }
    if has("vms") {
        timing.push(format!(
            "{:.0}+{:.0} s of load per guest",
            a.guest_warmup, a.guest_seconds
        ));
    }
    eprintln!(
        "memtide bench: {}; {} reps, warm-up+measured {}; tier and swap in {}",
        a.experiments.join(", "),
        reps,
        timing.join(", "),
        a.tier.display()
    );
    if has("micro") || has("memcached") || has("redis") {
        eprintln!(
            "  {} footprint; DRAM budgets {}",
            bytes(a.footprint),
            budgets
                .iter()
                .map(|b| bytes(*b))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let raw_p50 = if has("micro") {
        raw_read_p50_us(&a.tier).ok()
    } else {
        None
    };
    let zswap = !a.no_swap && !a.no_zswap && Path::new(ZSWAP).exists();
    if !a.no_swap && !a.no_zswap && !zswap {
        eprintln!("memtide: this kernel has no zswap; skipping the zswap configurations");
    }
    // Every configuration: name, budget fraction, placement, whether zswap is on.
    let mut configs: Vec<(String, f64, Placement, bool)> =
        vec![("all-DRAM".into(), 1.0, Placement::Dram, false)];
    for (i, &b) in budgets.iter().enumerate() {
        let pct = a.budgets[i];
        for &policy in &a.policy {
            for &faults in &a.faults {
                configs.push((
                    format!("memtide {pct:.0}%{}", variant(faults, policy)),
                    pct / 100.0,
                    Placement::Memtide {
                        dram: b,
                        tier: &a.tier,
                        preload: &preload,
                        faults,
                        policy,
                    },
                    false,
                ));
            }
        }
        if let Some(procs) = cgroups.get(i) {
            configs.push((
                format!("Linux swap {pct:.0}%"),
                pct / 100.0,
                Placement::Cgroup { procs },
                false,
            ));
            if zswap {
                configs.push((
                    format!("zswap {pct:.0}%"),
                    pct / 100.0,
                    Placement::Cgroup { procs },
                    true,
                ));
            }
        }
    }
    let configs = Configs(configs, cg.as_ref().map(|cg| cg.limit_file));
    let mut report = serde_json::Map::new();
    report.insert("footprint".into(), a.footprint.into());
    report.insert("budgets".into(), serde_json::json!(budgets));
    report.insert("reps".into(), a.reps().into());
    for e in &a.experiments {
        let section = match e.as_str() {
            "micro" => micro(&a, &configs, zswap, raw_p50)?,
            "memcached" => crate::kv::run(&a, crate::kv::Server::Memcached, &configs, zswap)?,
            "redis" => crate::kv::run(&a, crate::kv::Server::Redis, &configs, zswap)?,
            "quotas" => crate::quotas::quotas(&a)?,
            "density" | "noisy" | "vms" => {
                if zswap {
                    set_zswap(false)?;
                }
                let host = crate::tenants::Host {
                    tier: &a.tier,
                    preload: &preload,
                    cgroups: tenant_cgroups.as_ref(),
                };
                match e.as_str() {
                    "density" => crate::tenants::density(&a, &host)?,
                    "noisy" => crate::tenants::noisy(&a, &host)?,
                    _ => crate::vms::vms(&a, &host, guests.as_ref().expect("found above"))?,
                }
            }
            _ => unreachable!("checked above"),
        };
        report.insert(e.clone(), section);
    }
    drop(guard);
    if let Some(p) = &a.json {
        crate::report::write_json(p, &serde_json::Value::Object(report))?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The Linux-swap configuration a memtide configuration is compared with: the same budget.
pub fn swap_peer(config: &str, budget: f64) -> Option<String> {
    config
        .starts_with("memtide ")
        .then(|| format!("Linux swap {:.0}%", budget * 100.0))
}

/// What sets a memtide configuration apart in its name: nothing for the default delivery and
/// policy, " sig" for SIGBUS delivery, " placement" for placement.
pub(crate) fn variant(
    faults: memtide_engine::Delivery,
    policy: memtide_engine::EvictionPolicy,
) -> String {
    let mut name = String::new();
    if faults == memtide_engine::Delivery::Signal {
        name.push_str(" sig");
    }
    if policy == memtide_engine::EvictionPolicy::Placement {
        name.push_str(" placement");
    }
    name
}

/// Every configuration of a run (name, DRAM budget as a fraction, placement, zswap on), and
/// the Linux-swap cgroups' limit file.
pub struct Configs<'a>(
    pub Vec<(String, f64, Placement<'a>, bool)>,
    pub Option<&'static str>,
);

/// The microbenchmark: the built-in workload under every configuration.
fn micro(
    a: &BenchArgs,
    configs: &Configs,
    zswap: bool,
    raw_p50: Option<f64>,
) -> Result<serde_json::Value> {
    let mut same_dram = SameDram::new(a, configs);
    let configs = &configs.0;
    let total_runs = a.reps() * a.workloads.len() * a.threads.len() * configs.len();
    let mut records: Vec<RunRecord> = Vec::new();
    let started = Instant::now();
    for rep in 0..a.reps() {
        for wname in &a.workloads {
            let (hot, hot_share) = workload_shape(wname).expect("checked");
            for &threads in &a.threads {
                let w = WorkloadArgs {
                    footprint: a.footprint,
                    hot,
                    hot_share,
                    writes: 0.2,
                    seconds: a.seconds,
                    warmup: a.warmup,
                    threads,
                    rate: 0.0,
                    scan: false,
                    seed: 42 + rep as u64,
                };
                for (name, budget, place, zswap_on) in configs {
                    let budget = *budget;
                    if INTERRUPTED.load(Ordering::Relaxed) {
                        bail!("interrupted; settings restored");
                    }
                    if zswap {
                        set_zswap(*zswap_on)?;
                    }
                    let label = format!(
                        "{} {wname} {threads}t {name}",
                        step_label(records.len(), total_runs, started)
                    );
                    let cgroup_limit = same_dram.before(name, budget, place)?;
                    let o: Outcome = match run_workload(&label, &w, place) {
                        Ok(o) => o,
                        // Linux may kill a workload in its cgroup (out of memory with the
                        // swap device busy or zswap's pool charged to the cgroup): that is a
                        // result; a memtide run failing is not.
                        Err(e) if matches!(place, Placement::Cgroup { .. }) => {
                            eprintln!("{label}: failed: {e:#}");
                            records.push(RunRecord {
                                workload: wname.clone(),
                                threads,
                                config: name.clone(),
                                rep,
                                cgroup_limit,
                                failed: Some(format!("{e:#}")),
                                ..RunRecord::default()
                            });
                            continue;
                        }
                        Err(e) => return Err(e),
                    };
                    if o.result.mismatches > 0 {
                        bail!(
                            "{label}: {} pages read back wrong — a correctness failure, not a benchmark result",
                            o.result.mismatches
                        );
                    }
                    eprintln!(
                        "{label}: {:.0} k accesses/s, {:.2}% slow, fill {:.2} s, {} pages verified ({:.0} s)",
                        o.result.throughput / 1e3,
                        o.result.slow_fraction * 100.0,
                        o.result.fill_seconds,
                        o.result.verified_pages,
                        o.wall_seconds
                    );
                    records.push(RunRecord {
                        workload: wname.clone(),
                        threads,
                        config: name.clone(),
                        rep,
                        throughput: o.result.throughput,
                        fill_seconds: o.result.fill_seconds,
                        slow_fraction: o.result.slow_fraction,
                        slow_p50_us: o.result.slow_p50_us,
                        peak_rss: o.peak_rss,
                        tier_fault_p50_us: o.memtide.as_ref().map(|s| s.fault_tier_latency_p50_us),
                        tier_read_p50_us: o.memtide.as_ref().map(|s| s.tier_read_latency_p50_us),
                        peak_dram: o.memtide.as_ref().map(|s| s.peak_dram_bytes),
                        verified_pages: o.result.verified_pages,
                        cgroup_limit,
                        failed: None,
                    });
                    if let Some(s) = &o.memtide {
                        same_dram.saw(budget, beyond_quota(s, o.peak_rss));
                    }
                }
            }
        }
    }

    // Medians and ratios.
    let med = |w: &str, t: usize, c: &str, f: &dyn Fn(&RunRecord) -> f64| {
        median(
            records
                .iter()
                .filter(|r| r.workload == w && r.threads == t && r.config == c)
                .filter(|r| r.failed.is_none())
                .map(f)
                .collect(),
        )
    };
    let cw = config_width(configs.iter().map(|c| c.0.as_str()));
    let mut rows = Vec::new();
    println!();
    println!(
        "{:<8} {:>3} {:<cw$} {:>12} {:>9} {:>9} {:>9} {:>8} {:>10}",
        "workload",
        "thr",
        "config",
        "accesses/s",
        "vs DRAM",
        "vs swap",
        "miss",
        "fill s",
        "miss µs"
    );
    for w in &a.workloads {
        for &t in &a.threads {
            let dram = med(w, t, "all-DRAM", &|r| r.throughput);
            for (c, budget, _, _) in configs {
                let tp = med(w, t, c, &|r| r.throughput);
                let vs_swap = swap_peer(c, *budget)
                    .map(|swap| tp / med(w, t, &swap, &|r| r.throughput))
                    .filter(|v| v.is_finite());
                let row = Row {
                    workload: w.clone(),
                    threads: t,
                    config: c.clone(),
                    budget: *budget,
                    throughput_median: tp,
                    vs_dram: tp / dram,
                    vs_swap,
                    fill_median_seconds: med(w, t, c, &|r| r.fill_seconds),
                    slow_fraction_median: med(w, t, c, &|r| r.slow_fraction),
                    slow_p50_median_us: med(w, t, c, &|r| r.slow_p50_us),
                };
                let failed = records
                    .iter()
                    .filter(|r| &r.workload == w && r.threads == t && &r.config == c)
                    .filter(|r| r.failed.is_some())
                    .count();
                if tp.is_nan() {
                    println!(
                        "{:<8} {:>3} {:<cw$} {:>12} (every run was killed: {failed} of {})",
                        w,
                        t,
                        c,
                        "failed",
                        a.reps()
                    );
                    rows.push(row);
                    continue;
                }
                println!(
                    "{:<8} {:>3} {:<cw$} {:>12.0} {:>8.3}x {:>9} {:>8.3}% {:>8.2} {:>10}{}",
                    row.workload,
                    row.threads,
                    row.config,
                    row.throughput_median,
                    row.vs_dram,
                    row.vs_swap.map_or("-".into(), |v| format!("{v:.2}x")),
                    row.slow_fraction_median * 100.0,
                    row.fill_median_seconds,
                    if row.slow_p50_median_us > 0.0 {
                        format!("{:.0}", row.slow_p50_median_us)
                    } else {
                        "-".into()
                    },
                    if failed > 0 {
                        format!("  ({failed} of {} runs killed)", a.reps())
                    } else {
                        String::new()
                    }
                );
                rows.push(row);
            }
        }
    }
    println!(
        "(miss: accesses served from tier 1 or swap, i.e. slower than 20 µs; sampled 1 in 64; miss µs: their p50 as the program waits for them)"
    );
    same_dram.print();
    if a.faults.contains(&memtide_engine::Delivery::Signal) {
        println!("(sig: memtide with faults delivered as SIGBUS in the faulting thread, --faults signal; the others use handler threads)");
    }
    // One plot per workload: throughput against all-DRAM per budget, per family and threads.
    for w in &a.workloads {
        let mut series = Vec::new();
        for family in ["memtide", "Linux swap", "zswap"] {
            for &t in &a.threads {
                let points: Vec<(f64, f64)> = rows
                    .iter()
                    .filter(|r| &r.workload == w && r.threads == t && r.config.starts_with(family))
                    .map(|r| (r.budget, r.vs_dram))
                    .collect();
                if !points.is_empty() {
                    series.push(crate::plot::Series {
                        name: format!("{family}, {t} thr"),
                        points,
                    });
                }
            }
        }
        let path = PathBuf::from(format!("{}-{w}.svg", a.plot.display()));
        crate::plot::Chart::ratio_vs_budget(
            format!(
                "memtide bench: {w} workload over {}, throughput vs all-DRAM",
                bytes(a.footprint)
            ),
            "DRAM budget, fraction of the footprint",
            "throughput / all-DRAM",
            series,
        )
        .write(&path)?;
    }
    let fault_p50 = median(
        records
            .iter()
            .filter(|r| r.workload == a.workloads[0] && r.threads == a.threads[0])
            .filter_map(|r| r.tier_fault_p50_us)
            .collect(),
    );
    let fill_dram = median(
        records
            .iter()
            .filter(|r| r.config == "all-DRAM")
            .map(|r| r.fill_seconds)
            .collect(),
    );
    let fill_mt = median(
        records
            .iter()
            .filter(|r| r.config.starts_with("memtide"))
            .map(|r| r.fill_seconds)
            .collect(),
    );
    println!();
    println!(
        "first-touch fill of {}: all-DRAM {fill_dram:.2} s, memtide {fill_mt:.2} s ({:.2}x)",
        bytes(a.footprint),
        fill_mt / fill_dram
    );
    match raw_p50 {
        _ if fault_p50.is_nan() || fault_p50 <= 0.0 => println!("no tier-1 faults in these runs"),
        Some(raw) => println!(
            "tier-1 fault p50 {fault_p50:.0} µs vs raw O_DIRECT 4 KiB read p50 {raw:.0} µs on the same device (+{:.0} µs)",
            fault_p50 - raw
        ),
        None => println!("tier-1 fault p50 {fault_p50:.0} µs (raw device read not measured)"),
    }
    Ok(serde_json::json!({
        "threads": a.threads,
        "workloads": a.workloads,
        "seconds": a.seconds,
        "warmup": a.warmup,
        "rows": rows,
        "runs": records,
        "fill_dram_seconds": fill_dram,
        "fill_memtide_seconds": fill_mt,
        "tier_fault_p50_us": fault_p50,
        "raw_read_p50_us": raw_p50,
    }))
}

/// The width of a table's config column: the longest name ("memtide 50% sig placement"), at
/// least 16.
pub(crate) fn config_width<'a>(names: impl Iterator<Item = &'a str>) -> usize {
    names.map(|n| n.chars().count()).max().unwrap_or(0).max(16)
}
