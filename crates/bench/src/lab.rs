//! What the experiments of `memtide bench` share: the flags that apply to all of them
//! ([`Common`]), the configurations run side by side ([`Configs`]: all-DRAM, memtide at each
//! budget, Linux swap and zswap at the same budgets), how Linux swap gets the same DRAM as
//! memtide ([`SameDram`]), and the names and columns of their tables.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

use crate::demo::Placement;
use crate::opts;
use crate::system::Pool;

/// The flags every experiment reads.
#[derive(Args, Debug)]
pub struct Common {
    /// Memory each workload run touches (for memcached and redis: bytes of values stored).
    #[arg(long, value_parser = opts::nonzero_size, default_value = "2GiB")]
    pub footprint: u64,
    /// DRAM budgets, as percentages of the footprint (over 100: more DRAM than the workload
    /// touches, which measures memtide's overhead without pressure).
    #[arg(long, value_delimiter = ',', value_parser = opts::budget_percent, default_value = "75,50,25")]
    pub budgets: Vec<f64>,
    /// How memtide's configurations get their faults: `threads` (handler threads, the
    /// default), `signal` (SIGBUS in the faulting thread), or both (`threads,signal`: every
    /// memtide configuration twice, the SIGBUS one marked `sig`).
    #[arg(long, value_delimiter = ',', value_parser = opts::delivery, default_value = "threads")]
    pub faults: Vec<memtide_engine::Delivery>,
    /// Which pages memtide's configurations evict: `sweep` (the default), `placement`, or both
    /// (`sweep,placement`: every memtide configuration twice, the placement one marked
    /// `placement`). See `memtide run --policy`.
    #[arg(long, value_delimiter = ',', value_parser = opts::eviction_policy, default_value = "sweep")]
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
    /// Skip the zram configurations (a compressed RAM swap device, lz4, in front of the swap
    /// file).
    #[arg(long)]
    pub no_zram: bool,
    /// How memtide's configurations keep pages that leave DRAM: `lz4` (the default: a
    /// compressed pool within the budget, then tier 1), `zstd` (the pool compressed with
    /// zstd, marked `zstd`), `off` (tier 1 only, marked `file-only`), or several (`lz4,off`:
    /// every memtide configuration once with each).
    #[arg(long, value_delimiter = ',', value_parser = opts::compress, default_value = "lz4")]
    pub compress: Vec<memtide_engine::Compress>,
    /// memtide's compressed pool in the memtide configurations of micro, memcached, redis and
    /// vms: this share of the budget, fixed (as `memtide run --compressed-max`), instead of the
    /// default sixteenth.
    #[arg(long, value_parser = opts::percent, value_name = "SHARE")]
    pub compressed_max: Option<f64>,
    /// The share of each budget that zswap's and zram's compressed pools may take; their
    /// memory cgroup is limited to the rest (the pools live outside it), so that they have the
    /// same DRAM in all as the other configurations. (memtide's pool lives inside its budget:
    /// see --compressed-max.)
    #[arg(long, value_parser = opts::percent, default_value = "50")]
    pub pool_share: f64,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Plots, one SVG per workload: throughput against all-DRAM per DRAM budget, written to
    /// PREFIX-WORKLOAD.svg.
    #[arg(long, default_value = "memtide-bench")]
    pub plot: PathBuf,
}

impl Common {
    /// Repetitions of every configuration but the VM experiment's.
    pub fn reps(&self) -> usize {
        self.reps_given.unwrap_or(3)
    }

    /// Repetitions of the VM experiment's configurations.
    pub fn guest_reps(&self) -> usize {
        self.reps_given.unwrap_or(2)
    }
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
    /// Per Linux-swap configuration: its budget, the highest limit it ran under, its pool's cap.
    limits: Vec<(String, u64, u64, u64)>,
}

impl SameDram {
    pub fn new(c: &Common, configs: &Configs) -> SameDram {
        SameDram {
            footprint: c.footprint,
            limit_file: configs.1,
            unmanaged: Vec::new(),
            limits: Vec::new(),
        }
    }

    /// Before a run of configuration `name` at `budget` in `place`: a Linux-swap run gets its
    /// limit (returned), less `cap` bytes for a compressed `pool` outside the cgroup; others
    /// nothing. (zswap's pool is charged to the cgroup under cgroup v2: there the limit stays
    /// whole and `memory.zswap.max` caps the pool.)
    pub fn before(
        &mut self,
        name: &str,
        budget: f64,
        place: &Placement,
        pool: Pool,
        cap: u64,
    ) -> Result<Option<u64>> {
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
        let charged = pool == Pool::Zswap && file == "memory.max";
        let outside = if charged { 0 } else { cap };
        if charged {
            std::fs::write(dir.join("memory.zswap.max"), cap.to_string())
                .with_context(|| format!("cannot cap zswap in {}", dir.display()))?;
        }
        let limit = (budget + beyond.next_multiple_of(1 << 20)).saturating_sub(outside);
        std::fs::write(dir.join(file), limit.to_string())
            .with_context(|| format!("cannot set the memory limit of {}", dir.display()))?;
        match self.limits.iter_mut().find(|l| l.0 == name) {
            Some(l) => l.2 = l.2.max(limit),
            None => self.limits.push((name.to_string(), budget, limit, outside)),
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
        for (name, budget, limit, pool) in &self.limits {
            let less_pool = if *pool > 0 {
                format!(
                    ", less the {} its compressed pool may take outside the cgroup",
                    memtide_engine::size::format(*pool)
                )
            } else {
                String::new()
            };
            println!(
                "({name}: cgroup limit up to {}, the budget of {} plus the most anonymous memory memtide's runs at that budget kept beyond their quota{less_pool}, so that all have the same DRAM)",
                memtide_engine::size::format(*limit),
                memtide_engine::size::format(*budget),
            );
        }
    }
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
    compress: memtide_engine::Compress,
) -> String {
    let mut name = String::new();
    match compress {
        memtide_engine::Compress::Off => name.push_str(" file-only"),
        memtide_engine::Compress::Zstd => name.push_str(" zstd"),
        memtide_engine::Compress::Lz4 => {}
    }
    if faults == memtide_engine::Delivery::Signal {
        name.push_str(" sig");
    }
    if policy == memtide_engine::EvictionPolicy::Placement {
        name.push_str(" placement");
    }
    name
}

/// Every configuration of a run (name, DRAM budget as a fraction, placement, the kernel's
/// compressed pool in front of swap), and the Linux-swap cgroups' limit file.
pub struct Configs<'a>(
    pub Vec<(String, f64, Placement<'a>, Pool)>,
    pub Option<&'static str>,
);

/// The width of a table's config column: the longest name ("memtide 50% sig placement"), at
/// least 16.
pub(crate) fn config_width<'a>(names: impl Iterator<Item = &'a str>) -> usize {
    names.map(|n| n.chars().count()).max().unwrap_or(0).max(16)
}
