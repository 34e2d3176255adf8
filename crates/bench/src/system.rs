//! The system settings `memtide bench` changes for its Linux peers, and how it puts them back:
//! a swap file, zswap switched per run, memory cgroups ([`setup_swap`], [`TenantCgroups`]),
//! each recorded before it changes in a [`Guard`] that restores it when the bench ends, and
//! in a janitor process ([`janitor`], `memtide bench-janitor`) that restores it if the bench
//! dies without doing so. Interruptions stop the bench rather than kill it
//! ([`catch_interruptions`], [`interrupted`]).

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use memtide_engine::size::format as bytes;
use memtide_engine::sys;
use serde::{Deserialize, Serialize};

pub(crate) const ZSWAP: &str = "/sys/module/zswap/parameters/enabled";

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

/// Makes an interruption stop the bench rather than kill it. An async-signal-safe handler;
/// children still get the terminal's SIGINT and stop, and the bench cleans up. A hang-up or a
/// closed output pipe (whoever watched the bench went away) must not kill it before it
/// restores swap, zswap and cgroups: SIGHUP stops it like SIGINT, and SIGPIPE is ignored (a
/// write fails instead).
pub(crate) fn catch_interruptions() {
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        sys::set_signal_handler(sig, on_interrupt as *const () as libc::sighandler_t);
    }
    sys::set_signal_handler(libc::SIGPIPE, libc::SIG_IGN);
}

/// A setting the bench changed.
#[derive(Serialize, Deserialize, Debug)]
pub(crate) enum Restore {
    /// A swap file it switched on: off and removed.
    Swapfile(PathBuf),
    /// A cgroup it created: its processes killed, then removed.
    Cgroup(PathBuf),
    /// A file it wrote: the old value written back.
    Write(PathBuf, String),
    /// The zram device it used: swapped off and reset.
    Zram,
}

impl Restore {
    fn undo(&self) {
        match self {
            Restore::Swapfile(p) => {
                if p.exists() {
                    swap_off(p);
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
            Restore::Zram => {
                zram_off();
            }
        }
    }
}

/// The settings the bench changed, put back when it ends; and, while it runs, a janitor: a
/// process of its own that puts them back if the bench dies without doing so (killed with
/// SIGKILL, or a crash). The bench tells the janitor of each setting before changing it, over
/// a pipe; when the pipe closes without the bench's "done", the janitor restores them.
pub(crate) struct Guard {
    changed: Vec<Restore>,
    janitor: Option<(Child, ChildStdin)>,
}

impl Guard {
    /// A guard, with a janitor when `janitor` (settings of the whole system will change).
    pub(crate) fn new(janitor: bool) -> Result<Guard> {
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
    pub(crate) fn push(&mut self, r: Restore) -> Result<()> {
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

/// Memory cgroups for tenants run side by side (Linux swap's placement); each run sets the
/// limits it needs.
pub struct TenantCgroups {
    dirs: Vec<PathBuf>,
    limit_file: &'static str,
}

impl TenantCgroups {
    /// Creates `n` tenant cgroups under `cg`, each to be removed when `guard` goes.
    pub(crate) fn create(cg: &MemCgroup, n: usize, guard: &mut Guard) -> Result<TenantCgroups> {
        let mut dirs = Vec::new();
        for i in 0..n {
            let dir = cg
                .dir
                .join(format!("memtide-bench-{}-tenant{i}", std::process::id()));
            guard.push(Restore::Cgroup(dir.clone()))?;
            std::fs::create_dir(&dir)
                .with_context(|| format!("cannot create cgroup {}", dir.display()))?;
            dirs.push(dir);
        }
        Ok(TenantCgroups {
            dirs,
            limit_file: cg.limit_file,
        })
    }

    /// Limits tenant `i`'s cgroup to `bytes`; returns the file that takes the tenant's pid.
    pub fn limit(&self, i: usize, bytes: u64) -> Result<PathBuf> {
        let dir = &self.dirs[i];
        std::fs::write(dir.join(self.limit_file), bytes.to_string())
            .with_context(|| format!("cannot set the memory limit of {}", dir.display()))?;
        Ok(dir.join("cgroup.procs"))
    }
}

/// Where the memory controller is and how to limit a cgroup.
pub(crate) struct MemCgroup {
    pub(crate) dir: PathBuf,
    pub(crate) limit_file: &'static str,
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

/// Sets up Linux swap: a swap file of `swap_bytes` and more in `tier`, zswap off. Returns the
/// memory controller, for the cgroups.
pub(crate) fn setup_swap(tier: &Path, swap_bytes: u64, guard: &mut Guard) -> Result<MemCgroup> {
    if sys::effective_uid() != 0 {
        bail!("the Linux-swap configurations need root (swapon, cgroups); run as root or with --no-swap");
    }
    let cg = find_memory_cgroup()?;
    let others = std::fs::read_to_string("/proc/swaps")
        .unwrap_or_default()
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect::<Vec<_>>();
    if !others.is_empty() {
        eprintln!(
            "memtide: swap is already on ({}); the Linux configurations may swap there too, before or beside the bench's swap file",
            others.join(", ")
        );
    }
    // zswap is switched per run (off for Linux swap, on for zswap) and put back afterwards.
    if let Ok(v) = std::fs::read_to_string(ZSWAP) {
        guard.push(Restore::Write(PathBuf::from(ZSWAP), v.trim().to_string()))?;
        std::fs::write(ZSWAP, "N").context("cannot turn zswap off")?;
    }
    let swap = tier.join(format!("memtide-bench-{}.swap", std::process::id()));
    guard.push(Restore::Swapfile(swap.clone()))?;
    let size = swap_bytes + (256 << 20);
    let f = std::fs::File::create(&swap)
        .with_context(|| format!("cannot create {}", swap.display()))?;
    // Swap files must be fully allocated.
    if sys::allocate(&f, size).is_err() {
        bail!(
            "cannot allocate a {} swap file in {}",
            bytes(size),
            tier.display()
        );
    }
    drop(f);
    std::fs::set_permissions(&swap, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    run_cmd(Command::new("mkswap").arg(&swap), "mkswap")?;
    run_cmd(Command::new("swapon").arg(&swap), "swapon")?;
    Ok(cg)
}

/// The kernel's compressed pool a Linux configuration runs with, in front of the swap file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pool {
    /// None: plain Linux swap (or not a Linux configuration).
    None,
    /// zswap, with the compressor the kernel has.
    Zswap,
    /// A zram device (lz4) at a higher priority than the swap file.
    Zram,
}

const ZSWAP_MAX_POOL: &str = "/sys/module/zswap/parameters/max_pool_percent";
const ZRAM: &str = "/sys/block/zram0";
const ZRAM_DEV: &str = "/dev/zram0";

/// The compressed pools the bench runs its Linux configurations with, and what is switched
/// on now. Each pool may take `share` of a configuration's DRAM budget; the rest is its memory
/// cgroup's limit (the pools live outside the cgroup, so both have the same DRAM in all).
pub struct Pools {
    zswap: bool,
    zram: bool,
    share: f64,
    /// The most zram may hold uncompressed (the largest swap any run needs).
    zram_disk: u64,
    total_ram: u64,
    /// The zram device's size while it is on.
    zram_on: Option<u64>,
    /// Whether the bench said that zswap's cap is coarser than its share.
    warned_coarse: bool,
}

impl Pools {
    /// No pools (no Linux configurations, or `--no-swap`).
    pub(crate) fn none() -> Pools {
        Pools {
            zswap: false,
            zram: false,
            share: 0.0,
            zram_disk: 0,
            total_ram: 1,
            zram_on: None,
            warned_coarse: false,
        }
    }

    /// The pools this kernel has and the bench may use (zswap unless `no_zswap`, zram unless
    /// `no_zram` or the device is in use), each setting recorded in `guard` before it changes.
    /// `share` is the fraction of a budget a pool may take, `disk` what zram may hold.
    pub(crate) fn setup(
        no_zswap: bool,
        no_zram: bool,
        share: f64,
        disk: u64,
        guard: &mut Guard,
    ) -> Result<Pools> {
        let zswap = !no_zswap && Path::new(ZSWAP).exists();
        if !no_zswap && !zswap {
            eprintln!("memtide: this kernel has no zswap; skipping the zswap configurations");
        }
        if zswap {
            if let Ok(v) = std::fs::read_to_string(ZSWAP_MAX_POOL) {
                guard.push(Restore::Write(
                    PathBuf::from(ZSWAP_MAX_POOL),
                    v.trim().to_string(),
                ))?;
            }
        }
        let mut zram = false;
        if !no_zram {
            let initstate = std::fs::read_to_string(format!("{ZRAM}/initstate"));
            let lz4 = std::fs::read_to_string(format!("{ZRAM}/comp_algorithm")).is_ok_and(|a| {
                a.split_whitespace()
                    .any(|a| a.trim_matches(['[', ']']) == "lz4")
            });
            match initstate.as_deref().map(str::trim) {
                Err(_) => eprintln!(
                    "memtide: this kernel has no zram device ({ZRAM}); skipping the zram configurations"
                ),
                Ok("0") if !lz4 => eprintln!(
                    "memtide: this kernel's zram has no lz4; skipping the zram configurations"
                ),
                Ok("0") => {
                    // Put back as found: reset (empty, no swap), then its compressor.
                    let algorithms = std::fs::read_to_string(format!("{ZRAM}/comp_algorithm"))
                        .unwrap_or_default();
                    if let Some(current) = algorithms
                        .split_whitespace()
                        .find_map(|a| a.strip_prefix('[')?.strip_suffix(']'))
                    {
                        guard.push(Restore::Write(
                            PathBuf::from(format!("{ZRAM}/comp_algorithm")),
                            current.to_string(),
                        ))?;
                    }
                    guard.push(Restore::Zram)?;
                    zram = true;
                }
                Ok(_) => eprintln!(
                    "memtide: {ZRAM_DEV} is in use; skipping the zram configurations"
                ),
            }
        }
        Ok(Pools {
            zswap,
            zram,
            share,
            zram_disk: disk.next_multiple_of(1 << 20),
            total_ram: memtide_launch::preflight::machine_memory().max(1),
            zram_on: None,
            warned_coarse: false,
        })
    }

    /// Whether configurations with `pool` run.
    pub fn has(&self, pool: Pool) -> bool {
        match pool {
            Pool::None => true,
            Pool::Zswap => self.zswap,
            Pool::Zram => self.zram,
        }
    }

    /// The DRAM a pool may take out of a budget of `budget` bytes (whole MiB); 0 for none.
    pub fn cap(&self, pool: Pool, budget: u64) -> u64 {
        match pool {
            Pool::None => 0,
            Pool::Zswap | Pool::Zram => ((budget as f64 * self.share) as u64) & !((1 << 20) - 1),
        }
    }

    /// Switches on `pool` (and off the others) for a configuration with a budget of `budget`
    /// bytes, over pages that compress about `ratio`:1.
    ///
    /// zram cannot be capped by the DRAM it takes: at its memory limit it refuses pages the
    /// kernel keeps choosing it for, and reclaim spins (a run under a full zram device was
    /// seen making no progress for minutes). So it is sized instead: it holds `ratio` times
    /// the cap, uncompressed, and the kernel goes on to the swap file when it is full; what
    /// its pool really took is measured ([`zram_peak`](Self::zram_peak)).
    pub fn select(&mut self, pool: Pool, budget: u64, ratio: f64) -> Result<()> {
        let cap = self.cap(pool, budget);
        if self.zswap {
            set_zswap(pool == Pool::Zswap)?;
            if pool == Pool::Zswap {
                // A whole percentage of all RAM, at most the cap where it can be (at least 1:
                // on a large machine that is more than the cap, and the table would flatter
                // zswap; say so once).
                let exact = cap as f64 * 100.0 / self.total_ram as f64;
                if exact < 1.0 && !self.warned_coarse {
                    self.warned_coarse = true;
                    eprintln!(
                        "memtide: zswap's pool can only be capped at whole percentages of RAM: 1% is {} here, more than its share of {}",
                        bytes(self.total_ram / 100),
                        bytes(cap)
                    );
                }
                let pct = (exact.floor() as u64).max(1);
                std::fs::write(ZSWAP_MAX_POOL, pct.to_string())
                    .context("cannot set zswap's max_pool_percent")?;
            }
        }
        if self.zram {
            let want = (pool == Pool::Zram).then(|| {
                ((cap as f64 * ratio.max(1.0)) as u64)
                    .min(self.zram_disk)
                    .next_multiple_of(1 << 20)
                    .max(16 << 20)
            });
            if self.zram_on != want {
                if self.zram_on.is_some() && !zram_off() {
                    bail!("cannot switch {ZRAM_DEV} off (swapoff or reset failed); stopping");
                }
                self.zram_on = None;
                if let Some(disk) = want {
                    let set = |file: &str, v: String| {
                        std::fs::write(format!("{ZRAM}/{file}"), v)
                            .with_context(|| format!("cannot set {ZRAM}/{file}"))
                    };
                    set("comp_algorithm", "lz4".into())?;
                    set("disksize", disk.to_string())?;
                    run_cmd(Command::new("mkswap").arg(ZRAM_DEV), "mkswap on zram")?;
                    run_cmd(
                        Command::new("swapon").args(["-p", "100", ZRAM_DEV]),
                        "swapon zram",
                    )?;
                    self.zram_on = want;
                }
            }
            if self.zram_on.is_some() {
                // Each run's peak is its own.
                let _ = std::fs::write(format!("{ZRAM}/mem_used_max"), "0");
            }
        }
        Ok(())
    }

    /// The most DRAM zram's pool took since the last [`select`](Self::select) of it.
    pub fn zram_peak(&self) -> Option<u64> {
        self.zram_on?;
        let stat = std::fs::read_to_string(format!("{ZRAM}/mm_stat")).ok()?;
        stat.split_whitespace().nth(4)?.parse().ok()
    }
}

/// Swaps the zram device off and empties it (as many tries as swap's). Returns whether it is
/// off and empty.
fn zram_off() -> bool {
    let off = swap_off(Path::new(ZRAM_DEV));
    let _ = std::fs::write(format!("{ZRAM}/reset"), "1");
    off && std::fs::read_to_string(format!("{ZRAM}/initstate")).is_ok_and(|s| s.trim() == "0")
}

/// Whether `swap` (a file or device) is on, as /proc/swaps says.
fn swap_is_on(swap: &Path) -> bool {
    std::fs::read_to_string("/proc/swaps").is_ok_and(|s| s.contains(&*swap.to_string_lossy()))
}

/// Swaps `swap` off, trying again while pages still coming back make swapoff fail (10 tries,
/// 200 ms apart). Returns whether it is off.
fn swap_off(swap: &Path) -> bool {
    for _ in 0..10 {
        if !swap_is_on(swap) {
            return true;
        }
        let _ = Command::new("swapoff").arg(swap).output();
        if !swap_is_on(swap) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    !swap_is_on(swap)
}
