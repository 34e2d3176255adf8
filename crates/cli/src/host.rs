//! `memtide host` (the daemon that shares a host's DRAM among tenants) and `memtide status`
//! (the host and its tenants, once). Entry points: [`host`], [`status`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;

use memtide_engine::size::format as bytes;
use memtide_host::client::{default_socket, Client};
use memtide_host::daemon::{self, Host, HostConfig, HttpView, Shared};
use memtide_host::metrics;
use memtide_host::protocol::{HostStatus, Request, Response, TenantStatus};
use memtide_launch::{opts, preflight};
use memtide_policy::share::ShareRules;

#[derive(Args, Debug)]
pub struct HostArgs {
    /// DRAM the tenants share: bytes (e.g. 16GiB) or a share of this machine's memory (e.g.
    /// 50%). Each tenant is guaranteed its --dram (its minimum); the rest follows activeness.
    #[arg(long, value_parser = budget)]
    pub dram: Budget,
    /// Where tenants' tier files go (a directory).
    #[arg(long, default_value = "/var/tmp")]
    pub tier: PathBuf,
    /// Tier-1 capacity of the host (default: --ratio times the DRAM budget), shared among the
    /// tenants every epoch: each gets room for what it holds beyond its DRAM quota, then an
    /// equal part of the rest.
    #[arg(long, value_parser = opts::nonzero_size)]
    pub tier_size: Option<u64>,
    /// DRAM:tier ratio that sets the tier capacity when --tier-size is not given.
    #[arg(long, value_parser = ratio, default_value = "1:1")]
    pub ratio: f64,
    /// The socket tenants and clients connect to (mode 0660).
    #[arg(long, default_value_os_t = default_socket())]
    pub socket: PathBuf,
    /// A group whose members may connect (as tenants that see only themselves); root and the
    /// daemon's own user are admins.
    #[arg(long)]
    pub group: Option<String>,
    /// How often quotas are split again.
    #[arg(long, value_parser = opts::seconds, default_value = "1s")]
    pub epoch: f64,
    /// Every tenant encrypts the pages it moves to tier 1 (AES-256-GCM, a key per tenant run
    /// that lives only in its memory).
    #[arg(long)]
    pub encrypt_tier: bool,
    /// Serve the dashboard (/), Prometheus metrics (/metrics) and the status as JSON
    /// (/api/status) on this address; `off` for none. Anyone who reaches the address reads it
    /// (on loopback: every local user); it answers only requests whose Host is an IP address
    /// or localhost.
    #[arg(long, default_value = "127.0.0.1:9464")]
    pub metrics: String,
    /// What the HTTP side shows: `tenants` (each tenant's name, pid, uid and figures, as
    /// Prometheus labels and on the dashboard) or `host` (the host's totals only). Default:
    /// `host` when --group lets other users be tenants (on the socket a member sees only its
    /// own tenant), `tenants` otherwise.
    #[arg(long, value_parser = http_view)]
    pub http_view: Option<HttpView>,
    /// A tenant that sends no report for this long leaves (its quota and tier share go back),
    /// and a client connection that says nothing for this long is closed. Tenants report
    /// every --stats-interval of their `memtide run` (1 s unless told otherwise).
    #[arg(long, value_parser = opts::seconds, default_value = "30s")]
    pub tenant_timeout: f64,
}

fn http_view(s: &str) -> Result<HttpView, String> {
    match s {
        "tenants" => Ok(HttpView::Tenants),
        "host" => Ok(HttpView::Host),
        _ => Err(format!("`{s}`: expected tenants or host")),
    }
}

#[derive(Clone, Copy, Debug)]
pub enum Budget {
    Bytes(u64),
    Percent(f64),
}

fn budget(s: &str) -> Result<Budget, String> {
    if s.trim().ends_with('%') {
        opts::percent(s).map(Budget::Percent)
    } else {
        opts::nonzero_size(s).map(Budget::Bytes)
    }
}

fn ratio(s: &str) -> Result<f64, String> {
    let bad = || format!("`{s}` is not a DRAM:tier ratio: write 1:1 or 1:2");
    let (d, t) = s.split_once(':').ok_or_else(bad)?;
    let d: f64 = d.trim().parse().map_err(|_| bad())?;
    let t: f64 = t.trim().parse().map_err(|_| bad())?;
    if d > 0.0 && t >= 0.0 && d.is_finite() && t.is_finite() {
        Ok(t / d)
    } else {
        Err(bad())
    }
}

/// The gid of group `name` (from /etc/group), or of a number.
fn group_id(name: &str) -> Result<u32> {
    if let Ok(n) = name.parse() {
        return Ok(n);
    }
    let groups = std::fs::read_to_string("/etc/group").context("cannot read /etc/group")?;
    groups
        .lines()
        .find_map(|l| {
            let mut f = l.split(':');
            (f.next() == Some(name)).then(|| f.nth(1)?.parse().ok())?
        })
        .with_context(|| format!("--group {name}: no such group"))
}

fn metrics_addr(s: &str) -> Result<Option<SocketAddr>> {
    if s == "off" {
        return Ok(None);
    }
    s.parse().map(Some).with_context(|| {
        format!("--metrics {s}: expected an address such as 127.0.0.1:9464, or off")
    })
}

pub fn host(a: HostArgs) -> Result<ExitCode> {
    let budget_bytes = match a.dram {
        Budget::Bytes(b) => b,
        Budget::Percent(p) => (preflight::machine_memory() as f64 * p / 100.0) as u64,
    };
    if budget_bytes < daemon::MIN_QUOTA {
        bail!("--dram {}: too small a budget", bytes(budget_bytes));
    }
    let total = preflight::machine_memory();
    if budget_bytes > total {
        bail!(
            "--dram {} is more than this machine's {} of memory",
            bytes(budget_bytes),
            bytes(total)
        );
    }
    if !a.tier.is_dir() {
        bail!("--tier {}: not a directory", a.tier.display());
    }
    let metrics_at = metrics_addr(&a.metrics)?;
    let duration = |flag: &str, secs: f64| {
        Duration::try_from_secs_f64(secs).map_err(|_| anyhow::anyhow!("{flag}: too long a time"))
    };
    let (epoch, silence) = (
        duration("--epoch", a.epoch)?,
        duration("--tenant-timeout", a.tenant_timeout)?,
    );
    if silence < Duration::from_secs(1) {
        bail!(
            "--tenant-timeout: at least 1s (tenants report every --stats-interval, 1 s by default)"
        );
    }
    let cfg = HostConfig {
        budget_bytes,
        tier_dir: a.tier.clone(),
        tier_capacity_bytes: a
            .tier_size
            .unwrap_or((budget_bytes as f64 * a.ratio) as u64),
        socket: a.socket.clone(),
        group: a.group.as_deref().map(group_id).transpose()?,
        epoch,
        rules: ShareRules::default(),
        encrypt_tier: a.encrypt_tier,
        limits: Default::default(),
        silence,
        http_view: a.http_view.unwrap_or(if a.group.is_some() {
            HttpView::Host
        } else {
            HttpView::Tenants
        }),
    };
    let listener = daemon::bind(&cfg)?;
    let shared = Shared::new(Host::new(cfg.clone()));
    let served = match metrics_at {
        Some(addr) => {
            let (s, h) = (shared.clone(), shared.clone());
            Some(metrics::serve_http(
                addr,
                metrics::Routes {
                    status: Box::new(move || s.lock().http_status()),
                    history: Some(Box::new(move || h.lock().history_json())),
                },
            )?)
        }
        None => None,
    };
    eprintln!(
        "memtide host: sharing {} of DRAM, tier 1 in {} ({}), socket {}{}",
        bytes(cfg.budget_bytes),
        cfg.tier_dir.display(),
        bytes(cfg.tier_capacity_bytes),
        cfg.socket.display(),
        served
            .map(|a| format!(", dashboard at http://{a}/ (metrics: /metrics)"))
            .unwrap_or_default()
    );
    daemon::serve(listener, shared)?;
    Ok(ExitCode::SUCCESS)
}

#[derive(Args, Debug)]
pub struct StatusArgs {
    /// The host daemon's socket.
    #[arg(long, default_value_os_t = default_socket())]
    pub socket: PathBuf,
    /// Print the status as JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn fetch_status(socket: &std::path::Path) -> Result<HostStatus> {
    match Client::connect(socket)?.call(&Request::Status)? {
        Response::Status(s) => Ok(s),
        other => bail!("the host daemon answered {other:?} to a status request"),
    }
}

pub fn status(a: StatusArgs) -> Result<ExitCode> {
    let s = fetch_status(&a.socket)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&s)?);
    } else {
        print!("{}", render(&s));
    }
    Ok(ExitCode::SUCCESS)
}

/// The columns of the tenant table, as `memtide status` prints it and `memtide top` shows it.
/// `POOL` is the DRAM of the tenant's compressed pool (part of `DRAM`); `TIER` and `TIER MAX`
/// are the file's.
pub const COLUMNS: [&str; 15] = [
    "ID", "TENANT", "PID", "MIN", "QUOTA", "DRAM", "POOL", "TIER", "TIER MAX", "ACTIVE", "ACT%",
    "HEALTH", "FAULTS/s", "TIER/s", "PROMO/s",
];

/// Width and left alignment of each column in `memtide status`.
const LAYOUT: [(usize, bool); 15] = [
    (4, false),
    (24, true),
    (8, false),
    (11, false),
    (11, false),
    (11, false),
    (11, false),
    (11, false),
    (11, false),
    (11, false),
    (6, false),
    (7, true),
    (9, false),
    (9, false),
    (9, false),
];

/// One tenant's cells, in [`COLUMNS`] order; its name cut to `name_chars` characters (before
/// " (pinned)", for a pinned tenant).
pub fn tenant_row(t: &TenantStatus, name_chars: usize) -> [String; 15] {
    let mut name: String = t.name.chars().take(name_chars).collect();
    if t.pinned {
        name.push_str(" (pinned)");
    }
    [
        t.tenant.to_string(),
        name,
        t.pid.to_string(),
        bytes(t.min_bytes),
        bytes(t.quota_bytes),
        bytes(t.report.dram_bytes),
        bytes(t.report.compressed_pool_bytes),
        bytes(t.report.tier_bytes),
        if t.pinned {
            "-".into()
        } else {
            bytes(t.tier_share_bytes)
        },
        bytes(t.report.active_bytes),
        format!("{:.0}%", t.active_pct),
        t.health.clone(),
        format!("{:.0}", t.faults_per_second),
        format!("{:.0}", t.tier_faults_per_second),
        format!("{:.0}", t.promotions_per_second),
    ]
}

/// The status as text: a host line and a row per tenant.
pub fn render(s: &HostStatus) -> String {
    let latency = if s.tier_read_latency_p99_us > 0.0 {
        format!(
            "tier read p50 {:.0} µs, p99 {:.0} µs ({})",
            s.tier_read_latency_p50_us, s.tier_read_latency_p99_us, s.latency_health
        )
    } else {
        "no tier reads in the last interval".to_string()
    };
    let mut out = format!(
        "host     DRAM {} of {} budget (quotas {}), tier {} of {} in {}\n         active {} ({:.0}% of the budget, {}), {latency}, up {:.0} s\n",
        bytes(s.dram_bytes),
        bytes(s.budget_bytes),
        bytes(s.quota_bytes),
        bytes(s.tier_bytes),
        bytes(s.tier_capacity_bytes),
        s.tier_dir,
        bytes(s.active_bytes),
        s.active_bytes as f64 * 100.0 / s.budget_bytes.max(1) as f64,
        s.active_health,
        s.uptime_seconds
    );
    let line = |cells: &[String]| -> String {
        let mut l = String::new();
        for (i, (c, &(w, left))) in cells.iter().zip(&LAYOUT).enumerate() {
            if i > 0 {
                l.push(' ');
            }
            if left {
                l.push_str(&format!("{c:<w$}"));
            } else {
                l.push_str(&format!("{c:>w$}"));
            }
        }
        l.push('\n');
        l
    };
    out.push_str(&line(&COLUMNS.map(String::from)));
    for t in &s.tenants {
        out.push_str(&line(&tenant_row(t, if t.pinned { 15 } else { 24 })));
    }
    if s.tenants.is_empty() {
        out.push_str("     (no tenants: start programs with `memtide run --host -- PROGRAM`)\n");
    }
    out
}
