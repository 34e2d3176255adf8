//! `memtide bench --experiments vms`: how many virtual machines share a host's DRAM while
//! each keeps 90% (95%) of its all-DRAM throughput — the density experiment with real guests.
//!
//! Every guest is a QEMU process running the test guest of `vm/build-guest.sh`: 1 GiB of guest
//! RAM, of which its init fills 768 MiB and then serves a paced load (a fixed number of word
//! read-modify-writes per second, 99% of them in the first 20% of the memory, the rest anywhere)
//! and reports on its serial console how much of the load it kept up with. Under memtide and
//! Linux swap the guests split `--vm-dram` evenly; all-DRAM fits as many guests as that holds
//! and is also run at every count, as the reference for the same CPU sharing. KVM is used where
//! a guest runs under it, TCG otherwise. Entry point: [`vms`].

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use memtide_engine::launch::{die_with_parent, StatsDir};
use memtide_engine::size::format as bytes;
use serde::Serialize;

use crate::demo::Placement;
use crate::lab::{config_width, variant, Common};
use crate::opts;
use crate::report::{median, step_label};
use crate::system::{interrupted, Pool, Pools};
use crate::tenants::{report_fits, Family, Fit, Host};

/// The VM experiment's flags (`vms`).
#[derive(clap::Args, Debug)]
pub struct VmArgs {
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
    /// VMs: what the guests fill their memory with: `random` (incompressible) or `2x` (the
    /// second half of every page zero: about 2:1 under lz4, for the compressed pool and zram).
    #[arg(long, value_enum, default_value = "random")]
    pub guest_contents: GuestContents,
}

/// What a guest fills its memory with (`--guest-contents`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum GuestContents {
    #[default]
    Random,
    /// Half of every page zero.
    #[value(name = "2x")]
    Half,
}

impl GuestContents {
    /// The share of each page's words the guest keeps zero (its `zero_pct`).
    fn zero_pct(self) -> u32 {
        match self {
            GuestContents::Random => 0,
            GuestContents::Half => 50,
        }
    }

    /// About what lz4 makes of it (zram's device is sized by it).
    fn ratio(self) -> f64 {
        match self {
            GuestContents::Random => 1.0,
            GuestContents::Half => 2.0,
        }
    }

    fn name(self) -> &'static str {
        match self {
            GuestContents::Random => "random",
            GuestContents::Half => "2x",
        }
    }
}

/// Guest RAM, and how much of it the guest's load fills.
pub const GUEST_RAM: u64 = 1 << 30;
const FILL_MIB: u64 = 768;
/// The guest's load: `HOT_PCT`% of accesses in the first `ACTIVE_PCT`% of the filled memory.
const ACTIVE_PCT: u64 = 20;
const HOT_PCT: u64 = 99;
/// The anonymous memory and page tables a QEMU process keeps beside guest RAM (the TCG
/// translation buffer at `tb-size=64`, device state, its heap): 30.7 MiB measured on the
/// paced guest at `--dram 277MiB` (the summary's "more than managed DRAM"). memtide manages
/// guest RAM only, so its budget per guest is the guest's share of the host DRAM less this;
/// Linux swap's memory cgroup holds the whole process to the whole share. Anonymous memory is
/// what counts, as in the micro and kv experiments: QEMU's code and libraries are file pages
/// the page cache holds either way (with this reserve, seven guests' peak RSS sums were
/// 2.13 GiB under memtide and 2.14 GiB under Linux swap).
const QEMU_OWN: u64 = 32 << 20;

/// The least host DRAM a guest can be given: QEMU's own memory and 64 MiB of guest RAM.
pub fn least_share() -> u64 {
    QEMU_OWN + (64 << 20)
}

/// How the guests run.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Accel {
    Kvm,
    Tcg,
}

/// The test guest and how to run it.
pub struct Guests {
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    pub accel: Accel,
}

impl Guests {
    /// Finds the test guest (in `dir`, or target/guest beside the memtide binary, building it
    /// there with vm/build-guest.sh if it is missing) and probes KVM.
    pub fn find(dir: Option<&Path>) -> Result<Guests> {
        if crate::preflight::check_program("qemu-system-x86_64").is_err() {
            bail!("the vms experiment needs qemu-system-x86_64 (Debian: apt-get install qemu-system-x86)");
        }
        let exe = std::env::current_exe().context("cannot locate the memtide binary")?;
        let target = exe.parent().and_then(Path::parent).map(Path::to_path_buf);
        let given = dir;
        let dir = match (dir, &target) {
            (Some(d), _) => d.to_path_buf(),
            (None, Some(t)) => t.join("guest"),
            (None, None) => bail!("cannot tell where the test guest is: give --guest DIR"),
        };
        let (kernel, initrd) = (dir.join("vmlinuz"), dir.join("initramfs"));
        let script = target
            .as_deref()
            .and_then(Path::parent)
            .map(|r| r.join("vm/build-guest.sh"));
        // In a checkout, the default guest built before vm/init.c last changed is built again
        // (a guest given with --guest is the user's to rebuild).
        let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
        let stale = given.is_none()
            && script
                .as_deref()
                .and_then(|s| modified(&s.with_file_name("init.c")))
                .zip(modified(&initrd))
                .is_some_and(|(source, built)| source > built);
        if !kernel.is_file() || !initrd.is_file() || stale {
            match script.filter(|s| s.is_file()) {
                Some(script) => {
                    eprintln!(
                        "vms: building the test guest in {} ({})",
                        dir.display(),
                        script.display()
                    );
                    let out = Command::new("bash")
                        .arg(&script)
                        .arg(&dir)
                        .stdout(Stdio::null())
                        .output()
                        .context("cannot run vm/build-guest.sh")?;
                    if !out.status.success() {
                        bail!(
                            "building the test guest failed: {}",
                            String::from_utf8_lossy(&out.stderr).trim()
                        );
                    }
                }
                None => bail!(
                    "no test guest in {} (vmlinuz, initramfs): build one with vm/build-guest.sh {}",
                    dir.display(),
                    dir.display()
                ),
            }
        }
        let mut g = Guests {
            kernel,
            initrd,
            accel: Accel::Tcg,
        };
        let (accel, why) = g.probe_kvm();
        g.accel = accel;
        eprintln!("vms: {why}");
        Ok(g)
    }

    /// KVM if a small guest boots and finishes under it within 20 s, else TCG (with why).
    fn probe_kvm(&self) -> (Accel, String) {
        let usable = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/kvm")
            .is_ok();
        if !usable {
            return (
                Accel::Tcg,
                "no usable /dev/kvm: guests run under TCG (emulated, slower)".into(),
            );
        }
        let mut cmd = self.command(Accel::Kvm, "fill_mib=16 rounds=1");
        match run_console(&mut cmd, Duration::from_secs(20), |_, _| {}) {
            Ok(c) if c.lines.iter().any(|l| l.contains("PASS")) => {
                (Accel::Kvm, "guests run under KVM (a test guest ran under it)".into())
            }
            Ok(c) => (
                Accel::Tcg,
                format!(
                    "/dev/kvm is present but a test guest did not finish under KVM within 20 s{}: guests run under TCG (emulated, slower)",
                    if c.timed_out { " (nested guests hang on some hosts)" } else { "" }
                ),
            ),
            Err(e) => (Accel::Tcg, format!("KVM probe failed ({e:#}): guests run under TCG")),
        }
    }

    /// A QEMU command for one guest of `GUEST_RAM`, with `settings` on its kernel command line
    /// (see vm/init.c).
    fn command(&self, accel: Accel, settings: &str) -> Command {
        let mut cmd = Command::new("qemu-system-x86_64");
        cmd.args([
            "-accel",
            match accel {
                Accel::Kvm => "kvm",
                Accel::Tcg => "tcg,tb-size=64",
            },
        ])
        .args([
            "-m",
            &format!("{}M", GUEST_RAM >> 20),
            "-smp",
            "1",
            "-kernel",
        ])
        .arg(&self.kernel)
        .arg("-initrd")
        .arg(&self.initrd)
        .args([
            "-append",
            &format!("console=ttyS0 quiet panic=-1 {settings}"),
            "-nodefaults",
            "-display",
            "none",
            "-serial",
            "stdio",
            "-no-reboot",
        ])
        .stdin(Stdio::null());
        cmd
    }
}

/// What a guest printed, and how its QEMU ended.
struct Console {
    lines: Vec<String>,
    timed_out: bool,
    status: i32,
    peak_rss: u64,
    /// Faults the kernel counted as major (those that waited for a read: swap-ins).
    major_faults: u64,
    /// CPU time QEMU used, user and system.
    cpu_seconds: f64,
    stderr: String,
}

/// Where a guest's paced load is, as its console tells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// The first measured second has ended (the warm-up is over).
    Measuring,
    /// The load is done: the guest printed what it achieved.
    Done,
}

impl Phase {
    fn of(line: &str) -> Option<Phase> {
        if !line.contains("memtide-guest: paced") {
            None
        } else if line.contains("achieved") {
            Some(Phase::Done)
        } else if line.contains("paced second") && !line.contains("warm-up") {
            Some(Phase::Measuring)
        } else {
            None
        }
    }
}

/// Runs `cmd` (a QEMU with its console on stdout), killing it after `limit`; `at` is called
/// with QEMU's pid when the guest's load reaches each [`Phase`] (the first time). Call it from
/// a thread that lives as long as the guest (the guest dies with the thread that started it).
fn run_console(
    cmd: &mut Command,
    limit: Duration,
    mut at: impl FnMut(Phase, u32),
) -> Result<Console> {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    die_with_parent(cmd, libc::SIGKILL);
    let mut child = cmd.spawn().context("cannot start qemu-system-x86_64")?;
    let pid = child.id();
    let (out, mut err) = (
        child.stdout.take().expect("piped"),
        child.stderr.take().expect("piped"),
    );
    let (stop, stopped) = mpsc::channel::<()>();
    std::thread::scope(|s| {
        // The watchdog: kills the guest when its time is up, unless told it ended.
        let watchdog = s.spawn(move || {
            if let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(limit) {
                // Our own child, not yet reaped (we reap it below, after this thread has ended).
                let _ = memtide_engine::sys::kill(pid, libc::SIGKILL);
                return true;
            }
            false
        });
        let stderr = s.spawn(move || {
            let mut text = String::new();
            let _ = err.read_to_string(&mut text);
            text
        });
        let mut seen = Vec::new();
        let lines: Vec<String> = BufReader::new(out)
            .lines()
            .map_while(|l| l.ok())
            .inspect(|l| {
                if let Some(phase) = Phase::of(l).filter(|p| !seen.contains(p)) {
                    seen.push(phase);
                    at(phase, pid);
                }
            })
            .collect();
        let stderr = stderr.join().unwrap_or_default();
        // Reap only once the watchdog can no longer signal the pid.
        let _ = stop.send(());
        let timed_out = watchdog.join().unwrap_or(false);
        let (status, used) = memtide_engine::sys::wait_child(pid)?;
        Ok(Console {
            lines,
            timed_out,
            status,
            peak_rss: used.peak_rss,
            major_faults: used.major_faults,
            cpu_seconds: used.cpu_seconds,
            stderr,
        })
    })
}

/// One guest's result in one run (`None` achieved: it gave no result, e.g. Linux killed it).
#[derive(Serialize, Clone, Debug)]
struct GuestRun {
    /// Accesses per second the guest made in the measured seconds.
    achieved: Option<f64>,
    peak_rss: u64,
    /// Faults that waited for the device over the whole run (boot, fill, load): under memtide
    /// its tier-1 faults, otherwise the kernel's major faults (swap-ins).
    device_faults: u64,
    /// CPU time the guest's QEMU used, all threads (memtide's included), user and system.
    cpu_seconds: f64,
    /// memtide only: bytes read from and written to tier 1.
    #[serde(skip_serializing_if = "Option::is_none")]
    tier_read_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tier_write_bytes: Option<u64>,
    /// memtide only, over the whole run: faults served from tier 1 and their latency (the
    /// fault's, read and mapping included, as the guest's vCPU waited for it), and hint faults
    /// (a touch of a page memtide had unmapped but kept in DRAM).
    #[serde(skip_serializing_if = "Option::is_none")]
    tier_faults: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tier_fault_p50_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tier_fault_p99_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    hint_faults: Option<u64>,
    /// memtide with handler threads: the mean time a handler waited for a CPU each time it
    /// was woken (a fault, an I/O completion), microseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    handler_wait_us: Option<f64>,
    /// Faults per second in the measured seconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    measured: Option<Measured>,
    #[serde(skip_serializing_if = "Option::is_none")]
    failed: Option<String>,
}

/// How the guests of one run are placed: all-DRAM, memtide with one policy and delivery, or
/// Linux swap.
#[derive(Clone, Debug)]
struct VmConfig {
    name: String,
    family: Family,
    faults: memtide_engine::Delivery,
    policy: memtide_engine::EvictionPolicy,
    compress: memtide_engine::Compress,
    /// memtide's pool as a share of its budget (`--compressed-max`), or its default.
    pool_share: Option<f64>,
}

/// Every configuration: all-DRAM, memtide for each `--compress`, `--policy` and `--faults` (SIGBUS delivery
/// only under TCG: KVM reads guest memory from the kernel, which SIGBUS delivery fails with
/// EFAULT), and Linux swap where the machine allows it.
fn configs(a: &Common, host: &Host, accel: Accel, zram: bool) -> Vec<VmConfig> {
    let mut out = Vec::new();
    for family in Family::all(host) {
        if family != Family::Memtide {
            out.push(VmConfig {
                name: family.name().into(),
                family,
                faults: memtide_engine::Delivery::Threads,
                policy: Default::default(),
                compress: Default::default(),
                pool_share: None,
            });
            continue;
        }
        for &compress in &a.compress {
            for &policy in &a.policy {
                for &faults in &a.faults {
                    if faults == memtide_engine::Delivery::Signal && accel == Accel::Kvm {
                        continue;
                    }
                    let name = format!("memtide{}", variant(faults, policy, compress));
                    if !out.iter().any(|c: &VmConfig| c.name == name) {
                        out.push(VmConfig {
                            name,
                            family,
                            faults,
                            policy,
                            compress,
                            pool_share: a.compressed_max.map(|p| p / 100.0),
                        });
                    }
                }
            }
        }
    }
    if zram && host.cgroups.is_some() {
        out.push(VmConfig {
            name: Family::Zram.name().into(),
            family: Family::Zram,
            faults: memtide_engine::Delivery::Threads,
            policy: Default::default(),
            compress: Default::default(),
            pool_share: None,
        });
    }
    out
}

/// Counts taken at a [`Phase`] of a guest's load.
#[derive(Clone, Copy, Debug, Default)]
struct Mark {
    seconds: f64,
    device_faults: u64,
    hint_faults: u64,
}

/// Faults per second while the guest's load was measured (between the end of its first
/// measured second and its final line; memtide's counts are those of its statistics file,
/// written every second).
#[derive(Serialize, Clone, Copy, Debug)]
struct Measured {
    device_faults_per_s: f64,
    hint_faults_per_s: f64,
}

/// Major faults of process `pid` so far, all its threads (/proc/PID/stat, field 12).
fn major_faults(pid: u32) -> Option<u64> {
    memtide_engine::sys::stat_fields(&format!("/proc/{pid}/stat"))?
        .get(9)?
        .parse()
        .ok()
}

/// The rate in a guest's final line ("... achieved 199997/s (100.0% of the rate)").
fn achieved(lines: &[String]) -> Option<f64> {
    let l = lines
        .iter()
        .rev()
        .find(|l| l.contains("memtide-guest: paced") && l.contains("achieved"))?;
    l.split("achieved ")
        .nth(1)?
        .split('/')
        .next()?
        .trim()
        .parse()
        .ok()
}

/// Runs `n` guests side by side placed as `config` says, each with `share` of the host's DRAM.
/// A guest that fails under all-DRAM or memtide fails the experiment; one Linux kills in its
/// cgroup is a result.
fn run_guests(
    config: &VmConfig,
    host: &Host,
    g: &Guests,
    x: &VmArgs,
    n: usize,
    share: u64,
    pools: &mut Pools,
) -> Result<Vec<GuestRun>> {
    let family = config.family;
    // zram: one device for all the guests, its pool capped at their shares' pool share; each
    // guest's cgroup gets the rest of its share.
    let cap = if family == Family::Zram {
        pools.select(Pool::Zram, share * n as u64, x.guest_contents.ratio())?;
        pools.cap(Pool::Zram, share)
    } else {
        pools.select(Pool::None, 0, 1.0)?;
        0
    };
    let mut procs: Vec<Option<PathBuf>> = Vec::new();
    for i in 0..n {
        procs.push(match (family, host.cgroups) {
            (Family::Swap | Family::Zram, Some(cg)) => Some(cg.limit(i, share - cap)?),
            _ => None,
        });
    }
    let zero_pct = x.guest_contents.zero_pct();
    let settings = format!(
        "mode=paced fill_mib={FILL_MIB} rate={:.0} warmup={:.0} seconds={:.0} active_pct={ACTIVE_PCT} hot_pct={HOT_PCT} zero_pct={zero_pct}",
        x.guest_rate,
        x.guest_warmup.ceil(),
        x.guest_seconds.ceil()
    );
    // Booting and filling take about 8 s of CPU per guest under TCG, and the guests share
    // the machine's CPUs; be generous before calling a guest stuck.
    let limit = Duration::from_secs_f64(120.0 + 30.0 * n as f64 + x.guest_warmup + x.guest_seconds);
    let results: Vec<Result<GuestRun>> = std::thread::scope(|s| {
        let handles: Vec<_> = procs
            .iter()
            .enumerate()
            .map(|(i, procs)| {
                let settings = &settings;
                s.spawn(move || -> Result<GuestRun> {
                    let place = match (family, procs) {
                        (Family::Memtide, _) => Placement::Memtide {
                            dram: share - QEMU_OWN,
                            tier: host.tier,
                            preload: host.preload,
                            faults: config.faults,
                            policy: config.policy,
                            compress: config.compress,
                            pool_share: config.pool_share,
                        },
                        (Family::Swap | Family::Zram, Some(p)) => Placement::Cgroup { procs: p },
                        _ => Placement::Dram,
                    };
                    let mut stats =
                        StatsDir::new().context("cannot create a directory for the statistics")?;
                    let mut cmd = g.command(g.accel, settings);
                    place.apply(&mut cmd, &stats.0);
                    // What was counted when the measured seconds began and ended: memtide's
                    // statistics (written every second), or the kernel's major faults.
                    let mut marks: Vec<Mark> = Vec::new();
                    let start = Instant::now();
                    let c = run_console(&mut cmd, limit, |_, pid| {
                        marks.push(match config.family {
                            Family::Memtide => crate::summary::collect(&stats.0).main().map_or(
                                Mark::default(),
                                |(s, _)| Mark {
                                    seconds: s.elapsed_seconds,
                                    device_faults: s.faults_tier,
                                    hint_faults: s.faults_inactive,
                                },
                            ),
                            _ => Mark {
                                seconds: start.elapsed().as_secs_f64(),
                                device_faults: major_faults(pid).unwrap_or(0),
                                hint_faults: 0,
                            },
                        })
                    })?;
                    let measured = match marks[..] {
                        [a, b] if b.seconds > a.seconds => Some(Measured {
                            device_faults_per_s: (b.device_faults - a.device_faults) as f64
                                / (b.seconds - a.seconds),
                            hint_faults_per_s: (b.hint_faults - a.hint_faults) as f64
                                / (b.seconds - a.seconds),
                        }),
                        _ => None,
                    };
                    let memtide = crate::summary::collect(&stats.0)
                        .main()
                        .map(|(s, _)| s.clone());
                    // What memtide said inside this guest's QEMU, said with the guest's name
                    // (guests run side by side), and kept with its failure.
                    let said: Vec<String> = memtide_engine::say::Relay::new(&stats.0)
                        .take()
                        .into_iter()
                        .map(|(l, _)| l)
                        .collect();
                    stats.relayed();
                    for l in &said {
                        eprintln!("{} guest {i}: {l}", config.name);
                    }
                    // A guest that filled its memory without saying how is older than the
                    // setting (one that died before filling is judged below).
                    let filled = c.lines.iter().find(|l| l.contains("memtide-guest: filled"));
                    if zero_pct > 0 && filled.is_some_and(|l| !l.contains("of each page zero")) {
                        let dir = g.initrd.parent().unwrap_or(Path::new("."));
                        bail!(
                            "the test guest in {} predates --guest-contents (its console does not say what it filled): rebuild it with vm/build-guest.sh {}",
                            dir.display(),
                            dir.display()
                        );
                    }
                    match achieved(&c.lines) {
                        Some(rate) => Ok(GuestRun {
                            achieved: Some(rate),
                            peak_rss: c.peak_rss,
                            device_faults: memtide
                                .as_ref()
                                .map_or(c.major_faults, |m| m.faults_tier),
                            cpu_seconds: c.cpu_seconds,
                            tier_read_bytes: memtide.as_ref().map(|m| m.tier_read_bytes),
                            tier_write_bytes: memtide.as_ref().map(|m| m.tier_write_bytes),
                            tier_faults: memtide.as_ref().map(|m| m.faults_tier),
                            tier_fault_p50_us: memtide
                                .as_ref()
                                .map(|m| m.fault_tier_latency_p50_us),
                            tier_fault_p99_us: memtide
                                .as_ref()
                                .map(|m| m.fault_tier_latency_p99_us),
                            hint_faults: memtide.as_ref().map(|m| m.faults_inactive),
                            handler_wait_us: memtide
                                .as_ref()
                                .filter(|m| m.handler_runs > 0)
                                .map(|m| m.handler_wait_per_run_us()),
                            measured,
                            failed: None,
                        }),
                        None => Err(anyhow!(
                            "guest {i} gave no result ({}); its console ended:\n{}\n{}{}",
                            if c.timed_out {
                                format!("stopped after {:.0} s", limit.as_secs_f64())
                            } else {
                                format!("status {:#x}", c.status)
                            },
                            c.lines[c.lines.len().saturating_sub(8)..].join("\n"),
                            c.stderr.trim(),
                            said.iter().map(|l| format!("\n{l}")).collect::<String>()
                        )),
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow!("a guest's thread panicked")))
            })
            .collect()
    });
    let mut runs = Vec::new();
    for r in results {
        match r {
            Ok(r) => runs.push(r),
            Err(e) if matches!(family, Family::Swap | Family::Zram) => runs.push(GuestRun {
                achieved: None,
                peak_rss: 0,
                device_faults: 0,
                cpu_seconds: 0.0,
                tier_read_bytes: None,
                tier_write_bytes: None,
                tier_faults: None,
                tier_fault_p50_us: None,
                tier_fault_p99_us: None,
                hint_faults: None,
                handler_wait_us: None,
                measured: None,
                failed: Some(format!("{e:#}")),
            }),
            Err(e) => bail!("{}: {e:#}", config.name),
        }
    }
    Ok(runs)
}

#[derive(Serialize)]
struct VmRun {
    guests: usize,
    config: String,
    rep: usize,
    share: u64,
    /// zram: the most DRAM its pool took in the run (all the guests').
    #[serde(skip_serializing_if = "Option::is_none")]
    pool_peak: Option<u64>,
    runs: Vec<GuestRun>,
}

#[derive(Serialize)]
struct VmRow {
    guests: usize,
    config: String,
    /// Host DRAM per guest (memtide's budget is this less QEMU's own memory); `None`:
    /// unlimited.
    share: Option<u64>,
    /// Medians over the repetitions of the slowest guest's and the median guest's
    /// throughput, against all-DRAM with as many guests.
    worst_vs_dram: f64,
    median_vs_dram: f64,
    /// Median over the repetitions of the slowest guest's throughput, accesses/s.
    slowest: f64,
    /// Median over the repetitions of the guests' peak RSS added up.
    peak_rss_sum: f64,
    /// Median of the guests' faults that waited for the device (whole run).
    device_faults: f64,
    /// memtide only, medians over the guests (whole run): each guest's tier-fault p50 and
    /// p99, its hint faults.
    #[serde(skip_serializing_if = "Option::is_none")]
    tier_fault_p50_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tier_fault_p99_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    hint_faults: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    handler_wait_us: Option<f64>,
    /// Medians over the guests of their device faults and hint faults per second while
    /// measured.
    #[serde(skip_serializing_if = "Option::is_none")]
    measured_device_faults_per_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    measured_hint_faults_per_s: Option<f64>,
    killed: usize,
}

/// The VM density experiment.
pub fn vms(
    a: &Common,
    x: &VmArgs,
    host: &Host,
    g: &Guests,
    pools: &mut Pools,
) -> Result<serde_json::Value> {
    let fits = (x.vm_dram / GUEST_RAM) as usize;
    eprintln!(
        "vms: guests of {} ({FILL_MIB} MiB filled, contents {}; {HOT_PCT}% of accesses to {ACTIVE_PCT}% of it, the rest anywhere) at {:.0} k accesses/s each, sharing {} of DRAM; all-DRAM fits {fits}",
        bytes(GUEST_RAM),
        x.guest_contents.name(),
        x.guest_rate / 1e3,
        bytes(x.vm_dram)
    );
    let configs = configs(a, host, g.accel, pools.has(Pool::Zram));
    if !configs.iter().any(|c| c.family == Family::Memtide) {
        bail!("--faults signal: no SIGBUS delivery under KVM, which reads guest memory from the kernel; use --faults threads");
    }
    if g.accel == Accel::Kvm && a.faults.contains(&memtide_engine::Delivery::Signal) {
        eprintln!(
            "vms: no SIGBUS delivery under KVM (KVM reads guest memory from the kernel, which it would fail)"
        );
    }
    let total = a.guest_reps() * x.guests.len() * configs.len();
    let started = Instant::now();
    let mut records: Vec<VmRun> = Vec::new();
    for rep in 0..a.guest_reps() {
        for &n in &x.guests {
            let share = (x.vm_dram / n as u64) / (1 << 20) * (1 << 20);
            for config in &configs {
                if interrupted() {
                    bail!("interrupted; settings restored");
                }
                let label = format!(
                    "{} vms {n} guests {}{}",
                    step_label(records.len(), total, started),
                    config.name,
                    match config.family {
                        Family::Dram => String::new(),
                        Family::Memtide => format!(
                            ", {} of DRAM each ({} for guest RAM)",
                            bytes(share),
                            bytes(share - QEMU_OWN)
                        ),
                        Family::Swap => format!(", {} of DRAM each", bytes(share)),
                        Family::Zram => format!(
                            ", {} of DRAM each ({} cgroup, {} of zram's pool)",
                            bytes(share),
                            bytes(share - pools.cap(Pool::Zram, share)),
                            bytes(pools.cap(Pool::Zram, share))
                        ),
                    }
                );
                eprintln!("{label}: running");
                let runs = run_guests(config, host, g, x, n, share, pools)?;
                let pool_peak = (config.family == Family::Zram)
                    .then(|| pools.zram_peak())
                    .flatten();
                if let Some(p) = pool_peak {
                    eprintln!(
                        "{label}: zram's pool took up to {} for all the guests",
                        bytes(p)
                    );
                }
                let tp: Vec<f64> = runs.iter().map(|r| r.achieved.unwrap_or(0.0)).collect();
                let killed = runs.iter().filter(|r| r.failed.is_some()).count();
                eprintln!(
                    "{label}: slowest guest {:.0} k/s, median {:.0} k/s{}",
                    tp.iter().copied().fold(f64::INFINITY, f64::min) / 1e3,
                    median(tp.clone()) / 1e3,
                    if killed > 0 {
                        format!(", {killed} gave no result")
                    } else {
                        String::new()
                    }
                );
                records.push(VmRun {
                    guests: n,
                    config: config.name.clone(),
                    rep,
                    share,
                    pool_peak,
                    runs,
                });
            }
        }
    }

    let of = |n: usize, name: &str| {
        let name = name.to_string();
        records
            .iter()
            .filter(move |r| r.guests == n && r.config == name)
    };
    // The median over the guests that gave a result of a figure memtide's guests have.
    let per_guest = |n: usize, name: &str, f: fn(&GuestRun) -> Option<f64>| -> Option<f64> {
        let v: Vec<f64> = of(n, name)
            .flat_map(|r| r.runs.iter())
            .filter(|t| t.failed.is_none())
            .filter_map(f)
            .collect();
        (!v.is_empty()).then(|| median(v))
    };
    let width = config_width(configs.iter().map(|c| c.name.as_str()));
    let worst = |r: &VmRun| {
        r.runs
            .iter()
            .map(|t| t.achieved.unwrap_or(0.0))
            .fold(f64::INFINITY, f64::min)
    };
    let mid = |r: &VmRun| median(r.runs.iter().map(|t| t.achieved.unwrap_or(0.0)).collect());
    let mut rows = Vec::new();
    println!();
    println!(
        "{:>6} {:<width$} {:>10} {:>13} {:>13} {:>12} {:>13} {:>14} {:>17} {:>12} {:>16} {:>17}",
        "guests",
        "config",
        "DRAM each",
        "slowest/DRAM",
        "median/DRAM",
        "slowest k/s",
        "peak RSS sum",
        "device faults",
        "tier fault p50/99",
        "hint faults",
        "handler wait/run",
        "measured dev/hint"
    );
    for &n in &x.guests {
        let reference = median(of(n, "all-DRAM").map(mid).collect());
        for c in &configs {
            let name = c.name.as_str();
            let row = VmRow {
                guests: n,
                config: c.name.clone(),
                share: (c.family != Family::Dram)
                    .then(|| of(n, name).next().map_or(0, |r| r.share)),
                worst_vs_dram: median(of(n, name).map(worst).collect()) / reference,
                median_vs_dram: median(of(n, name).map(mid).collect()) / reference,
                slowest: median(of(n, name).map(worst).collect()),
                peak_rss_sum: median(
                    of(n, name)
                        .map(|r| r.runs.iter().map(|t| t.peak_rss as f64).sum())
                        .collect(),
                ),
                device_faults: per_guest(n, name, |t| Some(t.device_faults as f64)).unwrap_or(0.0),
                tier_fault_p50_us: per_guest(n, name, |t| t.tier_fault_p50_us),
                tier_fault_p99_us: per_guest(n, name, |t| t.tier_fault_p99_us),
                hint_faults: per_guest(n, name, |t| t.hint_faults.map(|h| h as f64)),
                handler_wait_us: per_guest(n, name, |t| t.handler_wait_us),
                measured_device_faults_per_s: per_guest(n, name, |t| {
                    t.measured.map(|m| m.device_faults_per_s)
                }),
                measured_hint_faults_per_s: (c.family == Family::Memtide)
                    .then(|| per_guest(n, name, |t| t.measured.map(|m| m.hint_faults_per_s)))
                    .flatten(),
                killed: of(n, name)
                    .map(|r| r.runs.iter().filter(|t| t.failed.is_some()).count())
                    .sum(),
            };
            let latency = match (row.tier_fault_p50_us, row.tier_fault_p99_us) {
                (Some(p50), Some(p99)) => format!("{p50:.0}/{p99:.0} µs"),
                _ => "-".into(),
            };
            println!(
                "{:>6} {:<width$} {:>10} {:>12.3}x {:>12.3}x {:>12.0} {:>13} {:>14.0} {:>17} {:>12} {:>16} {:>17}{}",
                n,
                row.config,
                row.share.map_or("unlimited".into(), bytes),
                row.worst_vs_dram,
                row.median_vs_dram,
                row.slowest / 1e3,
                bytes(row.peak_rss_sum as u64),
                row.device_faults,
                latency,
                row.hint_faults.map_or("-".into(), |h| format!("{h:.0}")),
                row.handler_wait_us
                    .map_or("-".into(), |w| format!("{w:.1} µs")),
                match (row.measured_device_faults_per_s, row.measured_hint_faults_per_s) {
                    (Some(d), Some(h)) => format!("{d:.0}/{h:.0} per s"),
                    (Some(d), None) => format!("{d:.0}/- per s"),
                    _ => "-".into(),
                },
                match (c.family, row.killed) {
                    (Family::Dram, _) if n > fits => "  (would not fit: reference only)".into(),
                    (_, 0) => String::new(),
                    (_, k) => format!("  ({k} guest runs gave no result)"),
                }
            );
            rows.push(row);
        }
    }
    println!();
    println!(
        "Faults are per guest over the whole run (boot, fill, load), medians over the guests, except \"measured\": device and hint faults per second while the load was measured; \"handler wait/run\": the mean time a handler thread waited for a CPU each time it was woken; \"sig\": faults served in the faulting vCPU thread (SIGBUS) instead of by handler threads."
    );
    println!(
        "all-DRAM fits {fits} guest{} of {} in {}; memtide's budget per guest is its share less {} for QEMU's own memory, which memtide does not manage.",
        if fits == 1 { "" } else { "s" },
        bytes(GUEST_RAM),
        bytes(x.vm_dram),
        bytes(QEMU_OWN)
    );
    let fit_rows: Vec<Fit> = rows
        .iter()
        .map(|r| Fit {
            n: r.guests,
            config: r.config.clone(),
            worst_vs_dram: r.worst_vs_dram,
            killed: r.killed,
        })
        .collect();
    let densities = report_fits(
        "guests",
        fits,
        &x.guests,
        &configs
            .iter()
            .filter(|c| c.family != Family::Dram)
            .map(|c| c.name.clone())
            .collect::<Vec<_>>(),
        &fit_rows,
        format!(
            "memtide bench: VM density, guests of {} sharing {} of DRAM",
            bytes(GUEST_RAM),
            bytes(x.vm_dram)
        ),
        &PathBuf::from(format!("{}-vms.svg", a.plot.display())),
    )?;
    Ok(serde_json::json!({
        "reps": a.guest_reps(),
        "host_dram": x.vm_dram,
        "guest_ram": GUEST_RAM,
        "fill_mib": FILL_MIB,
        "active_pct": ACTIVE_PCT,
        "hot_pct": HOT_PCT,
        "guest_contents": x.guest_contents.name(),
        "pool_share": a.pool_share,
        "memtide_pool_share": a.compressed_max,
        "guest_rate": x.guest_rate,
        "accel": format!("{:?}", g.accel),
        "all_dram_fits": fits,
        "rows": rows,
        "density": densities,
        "runs": records,
    }))
}

#[cfg(test)]
mod tests {
    use super::{achieved, major_faults, Phase};

    #[test]
    fn reads_the_rate_from_the_last_report() {
        let lines: Vec<String> = [
            "memtide-guest: paced second 3: 200041 accesses",
            "memtide-guest: paced 200000/s for 4.0 s after 3 s of warm-up: achieved 70182/s (35.1% of the rate)",
            "[   12.541379] reboot: Power down",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(achieved(&lines), Some(70182.0));
        assert_eq!(achieved(&lines[..1]), None);
    }

    #[test]
    fn the_console_tells_when_the_measured_seconds_begin_and_end() {
        let at = |l: &str| Phase::of(l);
        assert_eq!(
            at("memtide-guest: paced second 2 (warm-up): 200003 accesses"),
            None
        );
        assert_eq!(
            at("memtide-guest: paced second 3: 200041 accesses"),
            Some(Phase::Measuring)
        );
        assert_eq!(
            at("memtide-guest: paced 200000/s for 4.0 s after 3 s of warm-up: achieved 70182/s (35.1% of the rate)"),
            Some(Phase::Done)
        );
        assert_eq!(at("memtide-guest: filled 768 MiB"), None);
    }

    #[test]
    fn major_faults_are_read_from_proc() {
        let majflt = || memtide_engine::sys::usage_of_self().major_faults;
        let before = majflt();
        let read = major_faults(std::process::id()).unwrap();
        let after = majflt();
        assert!(before <= read && read <= after, "{before} {read} {after}");
        assert_eq!(major_faults(0), None);
    }
}
