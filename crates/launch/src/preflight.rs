//! Checks made before a program is started under memtide, so that every user mistake is one
//! clear line and nothing is left half done: the DRAM budget against the machine, the tier
//! path (exists, writable, O_DIRECT, room), userfaultfd permission, the program, and the
//! preload library. Entry point: [`check`].

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use memtide_engine::size;

/// What the checks found.
pub struct Ready {
    pub preload: PathBuf,
    /// Set when the tier filesystem has no O_DIRECT (buffered fallback).
    pub buffered_tier: bool,
}

/// Total DRAM of this machine in bytes.
pub fn machine_memory() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map_or(u64::MAX, |kib| kib * 1024)
}

pub fn check_dram(dram: u64) -> Result<()> {
    if dram < 64 << 10 {
        bail!(
            "--dram {} is too small: give at least 64KiB",
            size::format(dram)
        );
    }
    let total = machine_memory();
    if dram > total {
        bail!(
            "--dram {} is more than this machine's memory ({})",
            size::format(dram),
            size::format(total)
        );
    }
    Ok(())
}

pub fn check_uffd() -> Result<()> {
    memtide_engine::uffd::Uffd::open(memtide_engine::Delivery::Threads, false).map(drop)?;
    Ok(())
}

/// Checks the tier path the engine will create its file in.
pub fn check_tier(path: &Path, tier_size: Option<u64>) -> Result<bool> {
    let dir = if path.is_dir() {
        path.to_path_buf()
    } else {
        if path.exists() {
            bail!(
                "tier file {} already exists: give a directory, or a file name that is not taken",
                path.display()
            );
        }
        match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        }
    };
    if !dir.is_dir() {
        bail!(
            "tier path {} does not exist: create the directory, or give an existing one",
            dir.display()
        );
    }
    let probe = dir.join(format!(".memtide-probe-{}", std::process::id()));
    CString::new(probe.as_os_str().as_bytes()).context("tier path has a NUL byte")?;
    let (file, direct) =
        memtide_engine::sys::create_new_direct(&probe).map_err(|e| match e.raw_os_error() {
            Some(libc::EACCES) | Some(libc::EPERM) | Some(libc::EROFS) => anyhow::anyhow!(
                "tier path {} is not writable: choose a directory this user can write to",
                dir.display()
            ),
            _ => anyhow::anyhow!("cannot create a file in tier path {}: {e}", dir.display()),
        })?;
    let buffered = !direct;
    let room = memtide_engine::sys::allocate(&file, 1 << 20).err();
    drop(file);
    let _ = std::fs::remove_file(&probe);
    if let Some(e) = room {
        if e.raw_os_error() == Some(libc::ENOSPC) {
            bail!(
                "tier filesystem at {} is full: free some space or choose another path",
                dir.display()
            );
        }
    }
    let d = CString::new(dir.as_os_str().as_bytes()).context("tier path has a NUL byte")?;
    // SAFETY: statvfs fills the struct.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid path and out-pointer.
    unsafe { libc::statvfs(d.as_ptr(), &mut st) };
    let free = st.f_bavail as u64 * st.f_frsize as u64;
    let need = tier_size.unwrap_or(64 << 20);
    if free > 0 && free < need {
        bail!(
            "tier filesystem at {} has only {} free, less than the {} needed: free some space, choose another path, or lower --tier-size",
            dir.display(),
            size::format(free),
            size::format(need)
        );
    }
    Ok(buffered)
}

/// Finds the program the way the shell would.
pub fn check_program(program: &str) -> Result<()> {
    let is_exec = |p: &Path| {
        p.is_file() && std::fs::metadata(p).is_ok_and(|m| m.permissions().mode() & 0o111 != 0)
    };
    if program.contains('/') {
        if !is_exec(Path::new(program)) {
            bail!("program {program} does not exist or is not executable");
        }
        return Ok(());
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    if std::env::split_paths(&path).any(|d| is_exec(&d.join(program))) {
        return Ok(());
    }
    bail!("program `{program}` not found in PATH")
}

/// The preload library: beside this binary (as cargo builds them), or MEMTIDE_PRELOAD.
pub fn find_preload() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("MEMTIDE_PRELOAD") {
        let p = PathBuf::from(p);
        if p.is_file() {
            return Ok(p);
        }
        bail!("MEMTIDE_PRELOAD={} does not exist", p.display());
    }
    let exe = std::env::current_exe().context("cannot locate the memtide binary")?;
    let dir = exe.parent().unwrap_or(Path::new("."));
    for cand in [
        dir.join("libmemtide_preload.so"),
        dir.join("../lib/libmemtide_preload.so"),
    ] {
        if cand.is_file() {
            return Ok(cand);
        }
    }
    bail!(
        "cannot find libmemtide_preload.so beside {}: build it with `cargo build --release` (or set MEMTIDE_PRELOAD)",
        exe.display()
    )
}

/// All checks for starting `program` under memtide.
pub fn check(dram: u64, tier: &Path, tier_size: Option<u64>, program: &str) -> Result<Ready> {
    check_dram(dram)?;
    check_program(program)?;
    let buffered_tier = check_tier(tier, tier_size)?;
    check_uffd()?;
    let preload = find_preload()?;
    Ok(Ready {
        preload,
        buffered_tier,
    })
}
