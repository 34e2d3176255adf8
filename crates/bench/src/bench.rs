//! `memtide bench`: memtide beside all-DRAM, Linux swap and zswap, side by side in one run,
//! on the experiments asked for — the built-in workload (`micro`), memcached and redis (`kv`),
//! tenants sharing a host (`density`, `noisy`, `quotas`), QEMU guests (`vms`). Each experiment
//! is a module with its own flags; what they share is in `lab`, the system settings changed
//! for the Linux peers and their restoring in `system`. This module checks the flags, sets up
//! the peers, runs the experiments in turn and writes the JSON report. Every system setting
//! it changes is put back when it ends, however it ends. Entry point: [`bench`].

use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::Args;
use memtide_engine::size::format as bytes;

use crate::demo::Placement;
use crate::kv::KvArgs;
use crate::lab::{budget_bytes, variant, Common, Configs};
use crate::micro::{raw_read_p50_us, MicroArgs};
use crate::preflight;
use crate::system::{catch_interruptions, setup_swap, Guard, Pool, Pools, Restore, TenantCgroups};
use crate::tenants::TenantArgs;
use crate::vms::VmArgs;

/// The experiments `--experiments` names.
const EXPERIMENTS: [&str; 7] = [
    "micro",
    "memcached",
    "redis",
    "density",
    "noisy",
    "vms",
    "quotas",
];

/// Drops every item equal to one before it, keeping the order.
fn keep_first<T: PartialEq + Copy>(items: &mut Vec<T>) {
    let mut seen = Vec::new();
    items.retain(|x| {
        let new = !seen.contains(x);
        seen.push(*x);
        new
    });
}

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
    #[command(flatten)]
    pub common: Common,
    #[command(flatten, next_help_heading = "micro")]
    pub micro: MicroArgs,
    #[command(flatten, next_help_heading = "memcached and redis")]
    pub kv: KvArgs,
    #[command(flatten, next_help_heading = "density, noisy and quotas")]
    pub tenants: TenantArgs,
    #[command(flatten, next_help_heading = "vms")]
    pub vms: VmArgs,
}

pub fn bench(mut args: BenchArgs) -> Result<ExitCode> {
    // Once each, in the order given (`clock` and `sweep` are the same policy).
    keep_first(&mut args.common.policy);
    keep_first(&mut args.common.faults);
    keep_first(&mut args.common.compress);
    let a = &args.common;
    let (t, v) = (&args.tenants, &args.vms);
    if a.reps_given == Some(0) {
        bail!("--reps must be at least 1");
    }
    if a.compressed_max.is_some_and(|p| p > 75.0) {
        bail!(
            "--compressed-max {}: give at most 75 (the rest of the budget holds the pages in use)",
            a.compressed_max.unwrap_or_default()
        );
    }
    if a.pool_share > 90.0 {
        bail!(
            "--pool-share {}: give at most 90 (the rest of the budget is the program's cgroup)",
            a.pool_share
        );
    }
    for e in &args.experiments {
        if !EXPERIMENTS.contains(&e.as_str()) {
            bail!(
                "unknown experiment `{e}`: choose {}",
                EXPERIMENTS.join(", ")
            );
        }
        if ["memcached", "redis"].contains(&e.as_str()) {
            crate::kv::Server::from_name(e)
                .expect("known")
                .check_installed()?;
        }
    }
    args.kv.check()?;
    args.micro.check()?;
    let has = |e: &str| args.experiments.iter().any(|x| x == e);
    if has("memcached") {
        args.kv.check_server(crate::kv::Server::Memcached)?;
    }
    if a.footprint > preflight::machine_memory() / 2 {
        bail!("--footprint {} is more than half this machine's memory; the all-DRAM runs need it all in DRAM", bytes(a.footprint));
    }
    let most_tenants = t.tenants.iter().copied().max().unwrap_or(0);
    if has("density") {
        if t.tenants.is_empty() || t.tenants.iter().any(|&n| n == 0 || n > 64) {
            bail!("--tenants: give numbers of tenants from 1 to 64, like 2,4,8");
        }
        if t.host_dram / (most_tenants as u64) < 1 << 20 {
            bail!(
                "--host-dram {} split among {most_tenants} tenants leaves less than 1 MiB each",
                bytes(t.host_dram)
            );
        }
        let all = t.tenant_footprint * most_tenants as u64;
        if all > preflight::machine_memory() / 2 {
            bail!("{most_tenants} tenants of {} need {} for the all-DRAM runs, more than half this machine's memory; lower --tenants or --tenant-footprint", bytes(t.tenant_footprint), bytes(all));
        }
    }
    if has("noisy") && t.tenant_footprint + t.neighbour_footprint > preflight::machine_memory() / 2
    {
        bail!("--tenant-footprint plus --neighbour-footprint is more than half this machine's memory; the all-DRAM runs need it all in DRAM");
    }
    let most_guests = v.guests.iter().copied().max().unwrap_or(0);
    if has("vms") {
        if v.guests.is_empty() || v.guests.iter().any(|&n| n == 0 || n > 64) {
            bail!("--guests: give numbers of guests from 1 to 64, like 2,4,8");
        }
        let least = crate::vms::least_share();
        if v.vm_dram / (most_guests as u64) < least {
            bail!(
                "--vm-dram {} split among {most_guests} guests leaves less than {} each (QEMU's own memory and some guest RAM)",
                bytes(v.vm_dram),
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
        swap_bytes = swap_bytes.max(t.tenant_footprint * most_tenants as u64);
    }
    if has("noisy") {
        swap_bytes = swap_bytes.max(t.tenant_footprint + t.neighbour_footprint);
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
        Some(crate::vms::Guests::find(v.guest.as_deref())?)
    } else {
        None
    };
    catch_interruptions();
    let mut guard = Guard::new(!a.no_swap)?;
    let cg = if a.no_swap {
        None
    } else {
        Some(setup_swap(&a.tier, swap_bytes, &mut guard)?)
    };
    // Before the cgroups: the guard undoes in reverse, so the runs left in them are killed
    // before zram, which they may be swapped to, is switched off.
    let mut pools = if cg.is_some() {
        Pools::setup(
            a.no_zswap,
            a.no_zram,
            a.pool_share / 100.0,
            swap_bytes,
            &mut guard,
        )?
    } else {
        Pools::none()
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
    let tenant_cgroups =
        match &cg {
            Some(cg) if has("density") || has("noisy") || has("vms") => Some(
                TenantCgroups::create(cg, most_tenants.max(most_guests).max(2), &mut guard)?,
            ),
            _ => None,
        };

    let mut timing = Vec::new();
    let others = args.experiments.iter().any(|e| e != "vms");
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
            v.guest_warmup, v.guest_seconds
        ));
    }
    eprintln!(
        "memtide bench: {}; {} reps, warm-up+measured {}; tier and swap in {}",
        args.experiments.join(", "),
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
    // Every configuration: name, budget fraction, placement, the compressed pool in front of
    // swap.
    let mut configs: Vec<(String, f64, Placement, Pool)> =
        vec![("all-DRAM".into(), 1.0, Placement::Dram, Pool::None)];
    for (i, &b) in budgets.iter().enumerate() {
        let pct = a.budgets[i];
        for &compress in &a.compress {
            for &policy in &a.policy {
                for &faults in &a.faults {
                    configs.push((
                        format!("memtide {pct:.0}%{}", variant(faults, policy, compress)),
                        pct / 100.0,
                        Placement::Memtide {
                            dram: b,
                            tier: &a.tier,
                            preload: &preload,
                            faults,
                            policy,
                            compress,
                            pool_share: a.compressed_max.map(|p| p / 100.0),
                        },
                        Pool::None,
                    ));
                }
            }
        }
        if let Some(procs) = cgroups.get(i) {
            for (peer, pool) in [
                ("Linux swap", Pool::None),
                ("zswap", Pool::Zswap),
                ("zram", Pool::Zram),
            ] {
                if pools.has(pool) {
                    configs.push((
                        format!("{peer} {pct:.0}%"),
                        pct / 100.0,
                        Placement::Cgroup { procs },
                        pool,
                    ));
                }
            }
        }
    }
    let configs = Configs(configs, cg.as_ref().map(|cg| cg.limit_file));
    let mut report = serde_json::Map::new();
    report.insert("footprint".into(), a.footprint.into());
    report.insert("budgets".into(), serde_json::json!(budgets));
    report.insert("reps".into(), a.reps().into());
    for e in &args.experiments {
        let section = match e.as_str() {
            "micro" => crate::micro::run(a, &args.micro, &configs, &mut pools, raw_p50)?,
            "memcached" => crate::kv::run(
                a,
                &args.kv,
                crate::kv::Server::Memcached,
                &configs,
                &mut pools,
            )?,
            "redis" => crate::kv::run(a, &args.kv, crate::kv::Server::Redis, &configs, &mut pools)?,
            "quotas" => {
                pools.select(Pool::None, 0, 1.0)?;
                crate::quotas::quotas(a, t)?
            }
            "density" | "noisy" | "vms" => {
                pools.select(Pool::None, 0, 1.0)?;
                let host = crate::tenants::Host {
                    tier: &a.tier,
                    preload: &preload,
                    cgroups: tenant_cgroups.as_ref(),
                };
                match e.as_str() {
                    "density" => crate::tenants::density(a, t, &host)?,
                    "noisy" => crate::tenants::noisy(a, t, &host)?,
                    _ => crate::vms::vms(
                        a,
                        v,
                        &host,
                        guests.as_ref().expect("found above"),
                        &mut pools,
                    )?,
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
