//! Starting a program under memtide: the environment the preload library reads (the other half
//! of that contract is the preload crate's `Settings`), a private directory the program's
//! statistics are written to, and a parent-death signal, so that a program whose launcher is
//! killed does not run on unwatched; and the launcher's own signal plumbing. Entry points:
//! [`TierEnv::apply`], [`StatsDir::new`], [`die_with_parent`], [`forward_signals`],
//! [`default_sigpipe`].

use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicI32, Ordering};

use crate::uffd::Delivery;
use crate::EvictionPolicy;

/// The settings the preload library reads, as environment variables.
pub struct TierEnv<'a> {
    pub preload: &'a Path,
    pub dram: u64,
    pub tier: &'a Path,
    pub tier_size: Option<u64>,
    /// The most the tier size may be raised to at run time (through [`TIER_FILE`]).
    pub tier_max: Option<u64>,
    pub min_bytes: u64,
    pub stats_dir: &'a Path,
    pub stats_interval_ms: u64,
    pub faults: Delivery,
    /// Which pages leave DRAM (`MEMTIDE_POLICY`).
    pub policy: EvictionPolicy,
    pub encrypt_tier: bool,
    /// Record the pages each process brings into DRAM to `record-<pid>.raw` in the stats
    /// directory.
    pub record: bool,
}

/// Prefix of the raw recordings in the statistics directory (`record-<pid>.raw`).
pub const RECORD_PREFIX: &str = "record-";

impl TierEnv<'_> {
    pub fn apply(&self, cmd: &mut Command) {
        let mut preload = self.preload.as_os_str().to_owned();
        if let Some(old) = std::env::var_os("LD_PRELOAD").filter(|v| !v.is_empty()) {
            preload.push(" ");
            preload.push(old);
        }
        cmd.env("LD_PRELOAD", preload)
            .env("MEMTIDE_DRAM", self.dram.to_string())
            .env("MEMTIDE_TIER", self.tier)
            .env("MEMTIDE_MIN_BYTES", self.min_bytes.to_string())
            .env("MEMTIDE_STATS_DIR", self.stats_dir)
            .env(
                "MEMTIDE_STATS_INTERVAL_MS",
                self.stats_interval_ms.to_string(),
            )
            .env(
                "MEMTIDE_FAULTS",
                match self.faults {
                    Delivery::Threads => "threads",
                    Delivery::Signal => "signal",
                },
            );
        if let Some(t) = self.tier_size {
            cmd.env("MEMTIDE_TIER_SIZE", t.to_string());
        }
        if let Some(t) = self.tier_max {
            cmd.env("MEMTIDE_TIER_MAX", t.to_string());
        }
        cmd.env("MEMTIDE_POLICY", self.policy.name());
        if self.encrypt_tier {
            cmd.env("MEMTIDE_ENCRYPT_TIER", "1");
        }
        if self.record {
            cmd.env("MEMTIDE_RECORD", "1");
        }
    }
}

/// The file in the statistics directory through which the launcher changes the program's
/// DRAM quota at run time: a number of bytes, replaced whole (write, then rename).
pub const QUOTA_FILE: &str = "quota";

/// The same for the most bytes its tier 1 may hold (up to the `tier_max` it started with).
pub const TIER_FILE: &str = "tier";

/// Asks the program started with `stats_dir` to use a DRAM quota of `bytes` from now on (its
/// engine reads the request at its next statistics interval).
pub fn ask_quota(stats_dir: &Path, bytes: u64) -> io::Result<()> {
    ask(stats_dir, QUOTA_FILE, bytes)
}

/// Asks the program started with `stats_dir` to keep at most `bytes` in tier 1 from now on.
pub fn ask_tier_size(stats_dir: &Path, bytes: u64) -> io::Result<()> {
    ask(stats_dir, TIER_FILE, bytes)
}

fn ask(stats_dir: &Path, file: &str, bytes: u64) -> io::Result<()> {
    let tmp = stats_dir.join(format!(".{file}.tmp"));
    std::fs::write(&tmp, format!("{bytes}\n"))?;
    std::fs::rename(&tmp, stats_dir.join(file))
}

/// A private directory for the statistics files of one launch, and for what memtide says from
/// inside the program's processes (mode 0700 whatever the umask:
/// whoever can write in it can change the program's quota and tier size and forge its
/// figures), removed on drop. A launcher killed with SIGKILL cannot remove its own: the next
/// launch by the same user removes directories whose launcher is gone.
pub struct StatsDir(pub PathBuf, bool);

const STATS_PREFIX: &str = "memtide-stats-";

impl StatsDir {
    pub fn new() -> io::Result<StatsDir> {
        let base = std::env::temp_dir();
        remove_orphans(&base);
        for n in 0..1000 {
            let p = base.join(format!("{STATS_PREFIX}{}-{n}", std::process::id()));
            match std::fs::DirBuilder::new().mode(0o700).create(&p) {
                Ok(()) => {
                    // The mode given is masked by the umask (0277 would leave 0500): set it.
                    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o700))?;
                    return Ok(StatsDir(p, false));
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
        Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!("no free stats directory name in {}", base.display()),
        ))
    }
}

impl StatsDir {
    /// The launcher has printed what the program's processes said (or chosen not to): the
    /// directory's end prints nothing more.
    pub fn relayed(&mut self) {
        self.1 = true;
    }
}

impl Drop for StatsDir {
    /// Prints what the program's processes said, unless the launcher did ([`StatsDir::relayed`];
    /// see [`crate::say::Relay`]), and removes the directory.
    fn drop(&mut self) {
        if !self.1 {
            crate::say::Relay::new(&self.0).relay(false);
        }
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Removes this user's stats directories in `base` whose launcher no longer runs.
fn remove_orphans(base: &Path) {
    let Ok(rd) = std::fs::read_dir(base) else {
        return;
    };
    let me = crate::sys::effective_uid();
    for ent in rd.flatten() {
        if !ent
            .path()
            .symlink_metadata()
            .is_ok_and(|m| m.is_dir() && m.uid() == me)
        {
            continue;
        }
        let name = ent.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(STATS_PREFIX))
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(ent.path());
        }
    }
}

/// Makes the program `cmd` starts receive `signal` when the process that starts it dies
/// (`PR_SET_PDEATHSIG`), however it dies: a launcher killed with SIGKILL leaves no program
/// running unwatched. The signal follows the starting *thread*: start the program from a
/// thread that lives as long as it does.
pub fn die_with_parent(cmd: &mut Command, signal: i32) {
    // SAFETY: getpid has no preconditions.
    let parent = unsafe { libc::getpid() };
    // SAFETY: the closure runs between fork and exec and calls only async-signal-safe
    // functions (prctl, getppid, raise).
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, signal as libc::c_ulong) != 0 {
                return Err(io::Error::last_os_error());
            }
            // The parent may have died before the signal was armed.
            if libc::getppid() != parent {
                libc::raise(signal);
            }
            Ok(())
        });
    }
}

/// The program signals are forwarded to.
static FORWARD_TO: AtomicI32 = AtomicI32::new(0);

extern "C" fn forward(sig: i32) {
    let pid = FORWARD_TO.load(Ordering::Relaxed);
    if pid > 0 {
        // SAFETY: kill is async-signal-safe.
        unsafe { libc::kill(pid, sig) };
    }
}

/// From now on, SIGINT, SIGTERM, SIGHUP and SIGQUIT sent to this process are passed on to
/// process `pid` (the launched program decides what they mean).
pub fn forward_signals(pid: u32) {
    FORWARD_TO.store(pid as i32, Ordering::Relaxed);
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT] {
        // SAFETY: installing an async-signal-safe handler.
        unsafe { libc::signal(sig, forward as *const () as libc::sighandler_t) };
    }
}

/// Restores SIGPIPE's default action (Rust ignores it): a reader that closes the pipe on a
/// command's output is a normal way to stop it. Call before starting threads.
pub fn default_sigpipe() {
    // SAFETY: setting a signal disposition.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
}
