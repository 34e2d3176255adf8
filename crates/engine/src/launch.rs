//! Starting a program under memtide: the settings the preload library reads from the program's
//! environment (both halves of that contract: [`Settings`]), a private directory the program's
//! statistics are written to, and a parent-death signal, so that a program whose launcher is
//! killed does not run on unwatched; and the launcher's own signal plumbing. Entry points:
//! [`Settings::apply`], [`StatsDir::new`], [`die_with_parent`], [`forward_signals`],
//! [`default_sigpipe`].

use std::ffi::OsString;
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicI32, Ordering};

use crate::uffd::Delivery;
use crate::{Compress, EvictionPolicy};

/// What the engine in a launched program is told: one field per setting, written into the
/// program's environment by the launcher ([`Settings::apply`]) and read back by the preload
/// library ([`Settings::from_env`]). The variables' names live only here, beside both halves.
/// Adding a setting is a field, a line in each half, and the flag that fills it.
#[derive(Clone, Debug)]
pub struct Settings {
    /// The DRAM quota (`MEMTIDE_DRAM`; without it memtide is off in the program).
    pub dram: u64,
    /// Where tier 1 is created: a directory or a file name.
    pub tier: PathBuf,
    pub tier_size: Option<u64>,
    /// The most the tier size may be raised to at run time (through [`TIER_FILE`]).
    pub tier_max: Option<u64>,
    /// Allocations of at least this many bytes are managed.
    pub min_bytes: u64,
    /// Address space reserved for managed memory.
    pub arena: u64,
    /// Where the program's statistics (and memtide's words from inside it) go.
    pub stats_dir: Option<PathBuf>,
    pub stats_interval_ms: u64,
    pub faults: Delivery,
    /// Which pages leave DRAM.
    pub policy: EvictionPolicy,
    pub encrypt_tier: bool,
    /// How pages are compressed into the pool in DRAM, and the most DRAM the pool may take.
    pub compress: Compress,
    pub compressed_max: Option<u64>,
    /// Let the pool size itself, up to `compressed_max` (`--compressed-sizing adaptive`).
    pub compressed_adaptive: bool,
    /// Record the pages each process brings into DRAM to `record-<pid>.raw` in the stats
    /// directory.
    pub record: bool,
}

/// Prefix of the raw recordings in the statistics directory (`record-<pid>.raw`).
pub const RECORD_PREFIX: &str = "record-";

const DRAM: &str = "MEMTIDE_DRAM";
const TIER: &str = "MEMTIDE_TIER";
const TIER_SIZE: &str = "MEMTIDE_TIER_SIZE";
const TIER_MAX: &str = "MEMTIDE_TIER_MAX";
const MIN_BYTES: &str = "MEMTIDE_MIN_BYTES";
const ARENA: &str = "MEMTIDE_ARENA";
const STATS_DIR: &str = "MEMTIDE_STATS_DIR";
const STATS_INTERVAL_MS: &str = "MEMTIDE_STATS_INTERVAL_MS";
const FAULTS: &str = "MEMTIDE_FAULTS";
const POLICY: &str = "MEMTIDE_POLICY";
const ENCRYPT_TIER: &str = "MEMTIDE_ENCRYPT_TIER";
const RECORD: &str = "MEMTIDE_RECORD";
const COMPRESS: &str = "MEMTIDE_COMPRESS";
const COMPRESSED_MAX: &str = "MEMTIDE_COMPRESSED_MAX";
const COMPRESSED_ADAPTIVE: &str = "MEMTIDE_COMPRESSED_ADAPTIVE";

/// Allocations managed by default: 128 KiB and more.
pub const DEFAULT_MIN_BYTES: u64 = 128 << 10;
/// The smallest allocation memtide manages, whatever is asked: a page.
const MIN_MIN_BYTES: u64 = 4096;
/// Address space reserved for managed memory by default: 1 TiB.
const DEFAULT_ARENA: u64 = 1 << 40;
const DEFAULT_STATS_INTERVAL_MS: u64 = 1000;

impl Settings {
    /// Settings for a quota and a tier, everything else at its default.
    pub fn new(dram: u64, tier: impl Into<PathBuf>) -> Settings {
        Settings {
            dram,
            tier: tier.into(),
            tier_size: None,
            tier_max: None,
            min_bytes: DEFAULT_MIN_BYTES,
            arena: DEFAULT_ARENA,
            stats_dir: None,
            stats_interval_ms: DEFAULT_STATS_INTERVAL_MS,
            faults: Delivery::Threads,
            policy: EvictionPolicy::default(),
            encrypt_tier: false,
            compress: Compress::default(),
            compressed_max: None,
            compressed_adaptive: false,
            record: false,
        }
    }

    /// Sets `cmd` up to run under memtide with these settings, the preload library at
    /// `preload` going first.
    pub fn apply(&self, preload: &Path, cmd: &mut Command) {
        let mut libs = preload.as_os_str().to_owned();
        if let Some(old) = std::env::var_os("LD_PRELOAD").filter(|v| !v.is_empty()) {
            libs.push(" ");
            libs.push(old);
        }
        cmd.env("LD_PRELOAD", libs)
            .env(DRAM, self.dram.to_string())
            .env(TIER, &self.tier)
            .env(MIN_BYTES, self.min_bytes.to_string())
            .env(STATS_INTERVAL_MS, self.stats_interval_ms.to_string())
            .env(FAULTS, self.faults.name())
            .env(POLICY, self.policy.name())
            .env(COMPRESS, self.compress.name());
        // What is not set here must not come from the launcher's own environment either.
        let optional = [
            (
                ARENA,
                (self.arena != DEFAULT_ARENA).then(|| self.arena.to_string().into()),
            ),
            (STATS_DIR, self.stats_dir.clone().map(OsString::from)),
            (TIER_SIZE, self.tier_size.map(|t| t.to_string().into())),
            (TIER_MAX, self.tier_max.map(|t| t.to_string().into())),
            (ENCRYPT_TIER, self.encrypt_tier.then(|| "1".into())),
            (RECORD, self.record.then(|| "1".into())),
            (
                COMPRESSED_MAX,
                self.compressed_max.map(|m| m.to_string().into()),
            ),
            (
                COMPRESSED_ADAPTIVE,
                self.compressed_adaptive.then(|| "1".into()),
            ),
        ];
        for (name, value) in optional {
            match value {
                Some(v) => cmd.env(name, v),
                None => cmd.env_remove(name),
            };
        }
    }

    /// The statistics directory named in this process's environment, if any (read before
    /// the rest, so that memtide's words go there from the start).
    pub fn stats_dir_from_env() -> Option<PathBuf> {
        std::env::var_os(STATS_DIR).map(PathBuf::from)
    }

    /// The settings in this process's environment: `None` when memtide is off here (no
    /// quota) or the tier is missing. A value that does not parse is reported through `say`
    /// and replaced by its default.
    pub fn from_env(say: impl FnMut(String)) -> Option<Settings> {
        Self::from_vars(|name| std::env::var_os(name), say)
    }

    /// [`from_env`](Self::from_env) over any source of variables. Read in the order a
    /// program's start needs them: the quota and the tier first (without them memtide is off
    /// and nothing else is said), then the rest.
    fn from_vars(
        var: impl Fn(&str) -> Option<OsString>,
        mut say: impl FnMut(String),
    ) -> Option<Settings> {
        let text = |name: &str| var(name).and_then(|v| v.into_string().ok());
        let mut size = |name: &str| -> Option<u64> {
            let v = text(name)?;
            match crate::size::parse(&v) {
                Ok(n) => Some(n),
                Err(e) => {
                    say(format!("memtide: {name}: {e}"));
                    None
                }
            }
        };
        let dram = size(DRAM)?;
        let Some(tier) = var(TIER) else {
            say(format!(
                "memtide: {TIER} is not set; running without tiering"
            ));
            return None;
        };
        let min_bytes = size(MIN_BYTES)
            .unwrap_or(DEFAULT_MIN_BYTES)
            .max(MIN_MIN_BYTES);
        let tier_size = size(TIER_SIZE);
        let tier_max = size(TIER_MAX);
        let arena = size(ARENA).unwrap_or(DEFAULT_ARENA);
        let compressed_max = size(COMPRESSED_MAX);
        let faults = match text(FAULTS) {
            None => Delivery::Threads,
            Some(name) => Delivery::from_name(&name).unwrap_or_else(|| {
                say(format!(
                    "memtide: {FAULTS}={name}: expected threads or signal; using threads"
                ));
                Delivery::Threads
            }),
        };
        let compress = match text(COMPRESS) {
            None => Compress::default(),
            Some(name) => Compress::from_name(&name).unwrap_or_else(|| {
                say(format!(
                    "memtide: {COMPRESS}={name}: expected lz4, zstd or off; using lz4"
                ));
                Compress::default()
            }),
        };
        let policy = match text(POLICY) {
            None => EvictionPolicy::default(),
            Some(name) => EvictionPolicy::from_name(&name).unwrap_or_else(|| {
                say(format!(
                    "memtide: {POLICY}={name}: expected sweep or placement; using sweep"
                ));
                EvictionPolicy::default()
            }),
        };
        Some(Settings {
            dram,
            tier: PathBuf::from(tier),
            tier_size,
            tier_max,
            min_bytes,
            arena,
            stats_dir: var(STATS_DIR).map(PathBuf::from),
            stats_interval_ms: text(STATS_INTERVAL_MS)
                .and_then(|v| v.parse().ok())
                .unwrap_or(DEFAULT_STATS_INTERVAL_MS),
            faults,
            policy,
            encrypt_tier: text(ENCRYPT_TIER).is_some_and(|v| v == "1"),
            compress,
            compressed_max,
            compressed_adaptive: text(COMPRESSED_ADAPTIVE).is_some_and(|v| v == "1"),
            record: text(RECORD).is_some_and(|v| v == "1"),
        })
    }
}

/// In the statistics directory: the file the engines of one run share its quota through
/// (`engine/group.rs`).
pub const GROUP_FILE: &str = "memtide-group.shm";

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

/// Makes the program `cmd` starts join the memory cgroup whose `cgroup.procs` (or `tasks`)
/// file is `procs` before it runs anything (Linux swap's runs in the bench).
pub fn join_cgroup_at_start(cmd: &mut Command, procs: PathBuf) {
    // SAFETY: the closure only writes a file, which is async-signal-safe enough between fork
    // and exec in a single-threaded child.
    unsafe {
        cmd.pre_exec(move || std::fs::write(&procs, std::process::id().to_string()));
    }
}

/// Sends this process's stderr to `file` from now on (a launcher whose program already has
/// the stderr it was given).
pub fn stderr_to(file: &std::fs::File) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: dup2 of a descriptor the caller owns onto this process's stderr.
    if unsafe { libc::dup2(file.as_raw_fd(), libc::STDERR_FILENO) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// The variables `apply` sets on a command, as `from_vars` reads them.
    fn round_trip(s: &Settings) -> (Option<Settings>, Vec<String>) {
        let mut cmd = Command::new("true");
        s.apply(Path::new("/lib/libmemtide_preload.so"), &mut cmd);
        let vars: HashMap<String, Option<OsString>> = cmd
            .get_envs()
            .map(|(k, v)| (k.to_str().unwrap().to_owned(), v.map(OsString::from)))
            .collect();
        for name in [DRAM, TIER, MIN_BYTES, STATS_INTERVAL_MS, FAULTS, POLICY] {
            assert!(
                matches!(vars.get(name), Some(Some(_))),
                "{name} is always set"
            );
        }
        for name in [ARENA, STATS_DIR, TIER_SIZE, TIER_MAX, ENCRYPT_TIER, RECORD] {
            assert!(
                vars.contains_key(name),
                "{name} is set or removed, never inherited"
            );
        }
        let mut said = Vec::new();
        let back = Settings::from_vars(|k| vars.get(k).cloned().flatten(), |l| said.push(l));
        (back, said)
    }

    #[test]
    fn what_the_launcher_writes_the_library_reads_back() {
        let plain = Settings::new(64 << 20, "/var/tmp");
        let full = Settings {
            tier_size: Some(1 << 30),
            tier_max: Some(2 << 30),
            min_bytes: 16 << 10,
            arena: 1 << 36,
            stats_dir: Some(PathBuf::from("/tmp/memtide-stats")),
            stats_interval_ms: 250,
            faults: Delivery::Signal,
            policy: EvictionPolicy::Placement,
            encrypt_tier: true,
            record: true,
            ..Settings::new(3 << 30, "/var/tmp/t.tier")
        };
        for s in [plain, full] {
            let (back, said) = round_trip(&s);
            assert!(said.is_empty(), "{said:?}");
            assert_eq!(format!("{:?}", back.unwrap()), format!("{s:?}"));
        }
    }

    #[test]
    fn a_setting_that_does_not_parse_is_said_and_defaulted() {
        let vars: HashMap<&str, &str> = [
            (DRAM, "64MiB"),
            (TIER, "/var/tmp"),
            (MIN_BYTES, "lots"),
            (FAULTS, "carrier-pigeon"),
        ]
        .into();
        let mut said = Vec::new();
        let s = Settings::from_vars(|k| vars.get(k).map(OsString::from), |l| said.push(l)).unwrap();
        assert_eq!(s.min_bytes, DEFAULT_MIN_BYTES);
        assert_eq!(s.faults, Delivery::Threads);
        assert_eq!(said.len(), 2, "{said:?}");
        assert!(
            said[0].starts_with("memtide: MEMTIDE_MIN_BYTES:"),
            "{said:?}"
        );
        // No quota: memtide is off, silently.
        assert!(Settings::from_vars(|_| None, |l| said.push(l)).is_none());
        assert_eq!(said.len(), 2);
    }
}
