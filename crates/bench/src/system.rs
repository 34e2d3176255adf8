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
