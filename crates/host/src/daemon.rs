//! `memtide host`: owns the host's DRAM budget and tier capacity. Tenants (`memtide run
//! --host`) register over a Unix socket, report their figures every second and get their DRAM
//! quota and tier share back; every epoch the budget is split again by activeness and the tier
//! capacity by what each tenant holds beyond its quota (`memtide_policy::share`). A connection
//! that closes releases its tenant's shares at once. Entry point: [`serve`].
//!
//! # Who may do what
//!
//! The socket is mode 0660 (owner: the daemon's user; group: `--group`). The daemon asks the
//! kernel who connected (`SO_PEERCRED`): root and the daemon's own user are admins and may read
//! and change any tenant; anyone else may register one tenant on its connection and read and
//! change only that one.
//!
//! # What a tenant cannot do to the others
//!
//! - take another's minimum or push the quotas past the budget: every sum of tenants' figures
//!   saturates, and terms whose minimums would not fit are refused;
//! - hold the daemon: a member holds a bounded number of connections ([`gate::Limits`]), its
//!   requests wait beyond a rate, a connection idle for [`HostConfig::silence`] is closed,
//!   and a tenant that sends no accepted report for as long leaves (its shares go back);
//! - claim what cannot be true: a report is checked ([`TenantReport::check`]) and bounded by
//!   what its processes hold (/proc, [`procs`]: DRAM by their resident memory, the tier by
//!   their open tier files, activeness by both) and by the tier shares it was given; the
//!   process it names must descend from the one that connected;
//! - write into a terminal or a log: names are kept with their control characters written out.

use std::collections::BTreeMap;
use std::io::{BufReader, ErrorKind, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use memtide_engine::size::format as bytes;
use memtide_policy::share::{self, Demand, ShareRules, TierDemand};
use memtide_policy::{Health, HealthThresholds, PAGE_SIZE};

use crate::gate::{self, Gate};
use crate::history::History;
use crate::procs;
use crate::protocol::{
    self, Change, HostStatus, Registration, Request, Response, TenantReport, TenantStatus,
};

/// The smallest quota a tiered tenant can run with (the engine's own minimum), and the
/// smallest reservation of a pinned one.
pub const MIN_QUOTA: u64 = 64 << 10;

/// How long a connection may say nothing, and a tenant send no report, before it is closed and
/// the tenant leaves, unless told otherwise (`memtide host --tenant-timeout`). A tenant reports
/// every `--stats-interval` of its `memtide run`, at most 10 s.
pub const SILENCE: Duration = Duration::from_secs(30);

/// What the HTTP side (the dashboard, `/metrics`, `/api/*`) shows to anyone who reaches it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HttpView {
    /// Every tenant's figures with its name, pid and uid (what Prometheus and the dashboard
    /// need per tenant).
    Tenants,
    /// The host's totals only: tenants' names and figures stay on the socket, where a member
    /// sees only its own.
    Host,
}

/// What the daemon is asked to do.
#[derive(Clone, Debug)]
pub struct HostConfig {
    pub budget_bytes: u64,
    pub tier_dir: PathBuf,
    pub tier_capacity_bytes: u64,
    pub socket: PathBuf,
    /// Group allowed to connect (besides the daemon's user).
    pub group: Option<u32>,
    pub epoch: Duration,
    pub rules: ShareRules,
    /// Every tenant encrypts its tier pages.
    pub encrypt_tier: bool,
    /// Connections and request rates of members.
    pub limits: gate::Limits,
    /// How long a connection may be silent ([`SILENCE`] by default).
    pub silence: Duration,
    pub http_view: HttpView,
}

struct Tenant {
    name: String,
    pid: u32,
    uid: u32,
    /// The process that connected (the program descends from it).
    peer: u32,
    /// What its processes hold (/proc, each epoch; `None`: not known, for an admin's tenant
    /// whose process is in another pid namespace): no report may claim more.
    usage: Option<procs::Usage>,
    /// The largest tier share it was ever given: its engine's limit is never above it.
    tier_granted: u64,
    pinned: bool,
    min: u64,
    max: Option<u64>,
    quota: u64,
    /// Its share of the tier capacity.
    tier: u64,
    joined: Instant,
    report: TenantReport,
    /// The report before, and when each came (for rates).
    previous: Option<(Instant, TenantReport)>,
    reported: Instant,
    health: Health,
}

impl Tenant {
    fn demand(&self) -> Demand {
        let pages = |b: u64| b / PAGE_SIZE as u64;
        Demand {
            min: pages(self.min),
            max: self.max.map_or(u64::MAX, pages),
            pinned: self.pinned,
            held: pages(
                self.report
                    .dram_bytes
                    .saturating_add(self.report.tier_bytes),
            )
            .max(pages(self.report.managed_bytes)),
            active: pages(self.report.active_bytes),
        }
    }

    /// What it needs of the tier, at the DRAM quota it has.
    fn tier_demand(&self) -> TierDemand {
        let pages = |b: u64| b / PAGE_SIZE as u64;
        let r = &self.report;
        TierDemand {
            pinned: self.pinned,
            // What it may fill, and what its files still take on the filesystem.
            may_hold: if self.previous.is_none() {
                pages(self.tier)
            } else {
                pages(r.tier_bytes.max(r.tier_limit_bytes).max(r.tier_file_bytes))
            },
            only_in_tier: pages(
                r.tier_bytes
                    .min(r.managed_bytes.saturating_sub(r.dram_bytes)),
            ),
            beyond_quota: self.demand().held.saturating_sub(pages(self.quota)),
        }
    }

    /// The most its report can claim: what /proc shows its processes hold (a tenant's pages
    /// in DRAM are resident, its pages in the tier are in its open tier files), and a tier
    /// limit no larger than any share it was given.
    fn bounds(&self, capacity: u64) -> protocol::Bounds {
        let u = self.usage.unwrap_or(procs::Usage::UNBOUNDED);
        protocol::Bounds {
            managed: u.mapped,
            dram: u.resident,
            tier: u.tier_allocated,
            tier_limit: self.tier_granted.max(self.tier),
            tier_file: u.tier_length.min(capacity),
        }
    }

    fn active_pct(&self) -> f64 {
        if self.quota == 0 {
            return 0.0;
        }
        self.report.active_bytes as f64 * 100.0 / self.quota as f64
    }

    /// Tier-read latency at quantile `q` over the last report interval.
    fn recent_us(&self, q: f64) -> Option<f64> {
        protocol::window_quantile_us(&self.report, self.previous.as_ref().map(|(_, r)| r), q)
    }

    /// Active memory against the quota, and the tier-read p99 of the last interval.
    fn colour(&self, t: &HealthThresholds) -> Health {
        if self.pinned {
            return Health::Green;
        }
        let a = Health::of_active(self.report.active_bytes, self.quota, t);
        let l = self
            .recent_us(0.99)
            .map_or(Health::Green, |us| Health::of_latency(us, t));
        a.max(l)
    }
}

/// The daemon's state.
pub struct Host {
    cfg: HostConfig,
    tenants: BTreeMap<u64, Tenant>,
    next_id: u64,
    started: Instant,
    health: (Health, Health),
    thresholds: HealthThresholds,
    history: History,
}

fn log(msg: impl AsRef<str>) {
    eprintln!("memtide host: {}", msg.as_ref());
}

impl Host {
    pub fn new(cfg: HostConfig) -> Host {
        Host {
            cfg,
            tenants: BTreeMap::new(),
            next_id: 1,
            started: Instant::now(),
            health: (Health::Green, Health::Green),
            thresholds: HealthThresholds::default(),
            history: History::default(),
        }
    }

    fn guaranteed(&self, except: Option<u64>) -> u64 {
        self.tenants
            .iter()
            .filter(|(&id, _)| Some(id) != except)
            .fold(0, |sum, (_, t)| sum.saturating_add(t.min))
    }

    /// Whether a tenant (`except`: the one being changed, if any) may have these terms: a
    /// tiered tenant's minimum is one the engine can run with (a pinned one's reservation at
    /// least as much), the maximum is not below it, and the minimums of all tenants fit the
    /// budget.
    /// Returns them in whole pages (rounded up: quotas are split in pages).
    fn check_terms(
        &self,
        except: Option<u64>,
        pinned: bool,
        min: u64,
        max: Option<u64>,
    ) -> Result<(u64, Option<u64>), String> {
        let page = |b: u64| {
            b.checked_next_multiple_of(PAGE_SIZE as u64)
                .ok_or_else(|| format!("{b} bytes is more than any host has"))
        };
        let (min, max) = (page(min)?, max.map(page).transpose()?);
        if min < MIN_QUOTA {
            return Err(format!(
                "a {}'s minimum must be at least {}",
                if pinned {
                    "pinned tenant"
                } else {
                    "tiered tenant"
                },
                bytes(MIN_QUOTA)
            ));
        }
        if let Some(m) = max.filter(|&m| m < min) {
            return Err(format!(
                "maximum {} is below the minimum {}",
                bytes(m),
                bytes(min)
            ));
        }
        let taken = self.guaranteed(except);
        if taken
            .checked_add(min)
            .is_none_or(|sum| sum > self.cfg.budget_bytes)
        {
            return Err(format!(
                "cannot guarantee {}: {} of the host's {} is already guaranteed to other tenants",
                bytes(min),
                bytes(taken),
                bytes(self.cfg.budget_bytes)
            ));
        }
        Ok((min, max))
    }

    /// Admits a tenant for the process `peer` of user `uid` (an admin or not), whose
    /// processes hold `usage` (`None`: not in /proc), naming a program `pid_ok` says descends
    /// from `peer`.
    fn register(
        &mut self,
        mut r: Registration,
        who: (u32, u32, bool),
        usage: Option<procs::Usage>,
        pid_ok: bool,
    ) -> Result<u64, String> {
        let (uid, peer, admin) = who;
        if usage.is_none() && !admin {
            return Err(
                "cannot see the connecting process in /proc (another pid namespace?)".into(),
            );
        }
        if r.name.is_empty() || r.name.len() > protocol::MAX_NAME {
            return Err(format!(
                "a tenant's name must be 1 to {} bytes",
                protocol::MAX_NAME
            ));
        }
        r.name = protocol::printable(&r.name);
        (r.min_bytes, r.max_bytes) = self.check_terms(None, r.pinned, r.min_bytes, r.max_bytes)?;
        if !pid_ok {
            r.pid = peer;
        }
        let id = self.next_id;
        self.next_id += 1;
        let now = Instant::now();
        log(format!(
            "tenant {id} ({}, pid {}, uid {uid}) joined: minimum {}{}{}",
            r.name,
            r.pid,
            bytes(r.min_bytes),
            r.max_bytes
                .map(|m| format!(", maximum {}", bytes(m)))
                .unwrap_or_default(),
            if r.pinned {
                ", pinned (not tiered)"
            } else {
                ""
            }
        ));
        self.tenants.insert(
            id,
            Tenant {
                name: r.name,
                pid: r.pid,
                uid,
                peer,
                usage,
                tier_granted: 0,
                pinned: r.pinned,
                min: r.min_bytes,
                max: r.max_bytes,
                quota: r.min_bytes,
                tier: 0,
                joined: now,
                report: TenantReport::default(),
                previous: None,
                reported: now,
                health: Health::Green,
            },
        );
        self.rebalance();
        Ok(id)
    }

    /// Removes a tenant (`why`: how it went, for the log).
    fn leave(&mut self, id: u64, why: &str) {
        if let Some(t) = self.tenants.remove(&id) {
            log(format!(
                "tenant {id} ({}) {why} after {:.0} s; its {} quota goes back to the host",
                t.name,
                t.joined.elapsed().as_secs_f64(),
                bytes(t.quota)
            ));
            self.rebalance();
        }
    }

    /// Takes a tenant's figures, bounded by what its processes hold; `pid_ok`: the program
    /// it names is the connecting process or below it (else the pid is not taken). Returns its
    /// quota and tier share; `None` when it is no longer registered (it stopped reporting).
    fn report(&mut self, id: u64, mut r: TenantReport, pid_ok: bool) -> Option<(u64, u64)> {
        let capacity = self.cfg.tier_capacity_bytes;
        let t = self.tenants.get_mut(&id)?;
        let now = Instant::now();
        if r.pid != 0 && pid_ok {
            t.pid = r.pid;
        }
        r.pid = t.pid;
        r.bound(&t.bounds(capacity));
        let old = std::mem::replace(&mut t.report, r);
        t.previous = Some((t.reported, old));
        t.reported = now;
        Some((t.quota, t.tier))
    }

    fn change(&mut self, id: u64, c: &Change) -> Result<(), String> {
        let t = self
            .tenants
            .get(&id)
            .ok_or_else(|| format!("no tenant {id}"))?;
        let min = c.min_bytes.unwrap_or(t.min);
        let max = match c.max_bytes {
            Some(0) => None,
            Some(m) => Some(m),
            None => t.max,
        };
        let (min, max) = self.check_terms(Some(id), t.pinned, min, max)?;
        let t = self.tenants.get_mut(&id).expect("looked up above");
        t.min = min;
        t.max = max;
        log(format!(
            "tenant {id} ({}) now has minimum {}{}",
            t.name,
            bytes(min),
            max.map(|m| format!(", maximum {}", bytes(m)))
                .unwrap_or_default()
        ));
        self.rebalance();
        Ok(())
    }

    /// Splits the budget and the tier capacity again (each epoch, and when a tenant joins,
    /// leaves or changes).
    pub fn rebalance(&mut self) {
        let ids: Vec<u64> = self.tenants.keys().copied().collect();
        let demands: Vec<Demand> = ids.iter().map(|id| self.tenants[id].demand()).collect();
        let current: Vec<u64> = ids
            .iter()
            .map(|id| self.tenants[id].quota / PAGE_SIZE as u64)
            .collect();
        let budget = self.cfg.budget_bytes / PAGE_SIZE as u64;
        let quotas = share::split(budget, &demands, &current, &self.cfg.rules);
        for (id, q) in ids.iter().zip(quotas) {
            let t = self.tenants.get_mut(id).expect("tenant listed");
            let q = (q * PAGE_SIZE as u64).max(if t.pinned { 0 } else { MIN_QUOTA });
            t.quota = q;
        }
        let tier: Vec<TierDemand> = ids
            .iter()
            .map(|id| self.tenants[id].tier_demand())
            .collect();
        let shares = share::split_tier(self.cfg.tier_capacity_bytes / PAGE_SIZE as u64, &tier);
        for (id, s) in ids.iter().zip(shares) {
            let t = self.tenants.get_mut(id).expect("tenant listed");
            t.tier = s * PAGE_SIZE as u64;
            t.tier_granted = t.tier_granted.max(t.tier);
        }
    }

    /// Logs every tenant (and the host, as `s` shows it) whose colour changed, with the
    /// numbers behind it.
    fn health_events(&mut self, s: &HostStatus) {
        let th = self.thresholds;
        for (id, t) in self.tenants.iter_mut() {
            let now = t.colour(&th);
            if now != t.health {
                log(format!(
                    "tenant {id} ({}) turned {}: active {} of its {} quota ({:.0}%), tier read p99 {:.0} µs over the last interval",
                    t.name,
                    now.as_str(),
                    bytes(t.report.active_bytes),
                    bytes(t.quota),
                    t.active_pct(),
                    t.recent_us(0.99).unwrap_or(0.0)
                ));
                t.health = now;
            }
        }
        let now = (colour(&s.active_health), colour(&s.latency_health));
        if now != self.health {
            log(format!(
                "host active memory is {} ({} of the {} budget), tier read latency {} (p99 {:.0} µs)",
                now.0.as_str(),
                bytes(s.active_bytes),
                bytes(s.budget_bytes),
                now.1.as_str(),
                s.tier_read_latency_p99_us
            ));
            self.health = now;
        }
    }

    /// The processes tenants connected from, to look up in /proc outside the lock.
    pub fn peers(&self) -> Vec<u32> {
        let mut p: Vec<u32> = self.tenants.values().map(|t| t.peer).collect();
        p.sort_unstable();
        p.dedup();
        p
    }

    /// Ends an epoch: lets go of tenants that sent no report for [`HostConfig::silence`],
    /// takes what each tenant's processes hold now (`usage`, by connecting process; one no
    /// longer there holds nothing), splits the budget again, logs changes of colour, keeps a
    /// sample.
    pub fn epoch(&mut self, usage: &[(u32, Option<procs::Usage>)]) {
        let silence = self.cfg.silence;
        let silent: Vec<u64> = self
            .tenants
            .iter()
            .filter(|(_, t)| t.reported.elapsed() > silence)
            .map(|(&id, _)| id)
            .collect();
        for id in silent {
            self.leave(id, "stopped reporting");
        }
        for t in self.tenants.values_mut() {
            if let Some(&(_, u)) = usage.iter().find(|(p, _)| *p == t.peer) {
                // An admin's tenant out of sight stays as it was; anyone else's holds nothing.
                if u.is_some() || t.usage.is_some() {
                    t.usage = Some(u.unwrap_or_default());
                }
            }
        }
        self.rebalance();
        let s = self.status(None);
        self.health_events(&s);
        // What the HTTP side may not show is not kept either.
        let shown = match self.cfg.http_view {
            HttpView::Tenants => s,
            HttpView::Host => HostStatus {
                tenants: Vec::new(),
                ..s
            },
        };
        self.history
            .record(self.started.elapsed().as_secs_f64(), &shown);
    }

    /// The last hour's samples as JSON, as the HTTP side may show them (for the dashboard;
    /// under [`HttpView::Host`] they hold no tenants).
    pub fn history_json(&self) -> String {
        serde_json::to_string(&self.history.points().collect::<Vec<_>>()).unwrap_or_default()
    }

    /// The status as the HTTP side may show it ([`HttpView`]).
    pub fn http_status(&self) -> HostStatus {
        let mut s = self.status(None);
        if self.cfg.http_view == HttpView::Host {
            s.tenants.clear();
        }
        s
    }

    /// The host and the tenants `only` allows (all when `None`).
    pub fn status(&self, only: Option<u64>) -> HostStatus {
        let th = &self.thresholds;
        let mut s = HostStatus {
            budget_bytes: self.cfg.budget_bytes,
            tier_dir: self.cfg.tier_dir.display().to_string(),
            tier_capacity_bytes: self.cfg.tier_capacity_bytes,
            uptime_seconds: self.started.elapsed().as_secs_f64(),
            ..HostStatus::default()
        };
        for (&id, t) in &self.tenants {
            s.quota_bytes = s.quota_bytes.saturating_add(t.quota);
            s.dram_bytes = s.dram_bytes.saturating_add(t.report.dram_bytes);
            s.tier_bytes = s.tier_bytes.saturating_add(t.report.tier_bytes);
            s.active_bytes = s.active_bytes.saturating_add(t.report.active_bytes);
            let (p50, p99) = (
                t.recent_us(0.5).unwrap_or(0.0),
                t.recent_us(0.99).unwrap_or(0.0),
            );
            s.tier_read_latency_p50_us = s.tier_read_latency_p50_us.max(p50);
            s.tier_read_latency_p99_us = s.tier_read_latency_p99_us.max(p99);
            if only.is_some_and(|o| o != id) {
                continue;
            }
            let rate = |f: fn(&TenantReport) -> u64| match &t.previous {
                Some((at, old)) => {
                    let dt = t.reported.duration_since(*at).as_secs_f64();
                    if dt > 0.0 {
                        f(&t.report).saturating_sub(f(old)) as f64 / dt
                    } else {
                        0.0
                    }
                }
                None => 0.0,
            };
            s.tenants.push(TenantStatus {
                tenant: id,
                name: t.name.clone(),
                pid: t.pid,
                uid: t.uid,
                pinned: t.pinned,
                min_bytes: t.min,
                max_bytes: t.max,
                quota_bytes: t.quota,
                tier_share_bytes: t.tier,
                active_pct: t.active_pct(),
                health: t.colour(th).as_str().into(),
                faults_per_second: rate(|r| {
                    r.faults_zero
                        .saturating_add(r.faults_tier)
                        .saturating_add(r.faults_inactive)
                }),
                tier_faults_per_second: rate(|r| r.faults_tier),
                promotions_per_second: rate(|r| r.promotions),
                recent_read_p50_us: p50,
                recent_read_p99_us: p99,
                seconds: t.joined.elapsed().as_secs_f64(),
                report: t.report.clone(),
            });
        }
        s.active_health = Health::of_active(s.active_bytes, s.budget_bytes, th)
            .as_str()
            .into();
        s.latency_health = Health::of_latency(s.tier_read_latency_p99_us, th)
            .as_str()
            .into();
        s
    }
}

fn colour(s: &str) -> Health {
    match s {
        "red" => Health::Red,
        "yellow" => Health::Yellow,
        _ => Health::Green,
    }
}

/// The daemon's shared state: the host, and the gate its connections pass.
#[derive(Clone)]
pub struct Shared {
    host: Arc<Mutex<Host>>,
    gate: Arc<Mutex<Gate>>,
}

impl Shared {
    pub fn new(host: Host) -> Shared {
        let limits = host.cfg.limits;
        Shared {
            host: Arc::new(Mutex::new(host)),
            gate: Arc::new(Mutex::new(Gate::new(limits))),
        }
    }

    /// The state. A panic in one connection's thread cannot leave it half-changed in a way
    /// that matters (every change is one field at a time), so a poisoned lock is taken as is.
    pub fn lock(&self) -> MutexGuard<'_, Host> {
        self.host.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn gate(&self) -> MutexGuard<'_, Gate> {
        self.gate.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Creates the socket (replacing a stale one, refusing if a daemon answers there), mode 0660.
pub fn bind(cfg: &HostConfig) -> Result<UnixListener> {
    let path = &cfg.socket;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            bail!(
                "another memtide host daemon is listening at {}",
                path.display()
            );
        }
        std::fs::remove_file(path)
            .with_context(|| format!("cannot remove the stale socket {}", path.display()))?;
    }
    let l =
        UnixListener::bind(path).with_context(|| format!("cannot listen at {}", path.display()))?;
    if let Some(gid) = cfg.group {
        std::os::unix::fs::chown(path, None, Some(gid))
            .with_context(|| format!("cannot give {} to group {gid}", path.display()))?;
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
        .with_context(|| format!("cannot set the mode of {}", path.display()))?;
    Ok(l)
}

/// Logs at most once per `every`, with how many were not logged in between.
struct Quiet {
    every: Duration,
    last: Option<Instant>,
    skipped: u64,
}

impl Quiet {
    fn new(every: Duration) -> Quiet {
        Quiet {
            every,
            last: None,
            skipped: 0,
        }
    }

    fn log(&mut self, msg: impl AsRef<str>) {
        if self.last.is_some_and(|l| l.elapsed() < self.every) {
            self.skipped += 1;
            return;
        }
        let more = std::mem::take(&mut self.skipped);
        log(if more > 0 {
            format!("{} ({more} more like it not logged)", msg.as_ref())
        } else {
            msg.as_ref().to_string()
        });
        self.last = Some(Instant::now());
    }
}

/// Accepts tenants and clients until the process ends; a thread splits the budget every epoch.
pub fn serve(listener: UnixListener, host: Shared) -> Result<()> {
    let epoch = host.lock().cfg.epoch;
    {
        let host = host.clone();
        std::thread::Builder::new()
            .name("memtide-epoch".into())
            .spawn(move || loop {
                std::thread::sleep(epoch);
                // /proc is read outside the lock: tenants' reports do not wait for it.
                let peers = host.lock().peers();
                let usage: Vec<(u32, Option<procs::Usage>)> = peers
                    .into_iter()
                    .map(|peer| (peer, procs::usage_of(peer)))
                    .collect();
                host.lock().epoch(&usage);
            })?;
    }
    let mut refused = Quiet::new(Duration::from_secs(10));
    let mut failed = Quiet::new(Duration::from_secs(10));
    for conn in listener.incoming() {
        let conn = match conn {
            Ok(c) => c,
            Err(e) => {
                // Out of file descriptors or memory: wait for connections to close rather
                // than try again at once, round and round.
                failed.log(format!("cannot accept a connection: {e}"));
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let Ok((pid, uid, _)) = memtide_engine::sys::peer_credentials(&conn) else {
            continue;
        };
        let admin = uid == 0 || uid == memtide_engine::sys::effective_uid();
        let admitted = host.gate().admit(uid, admin, Instant::now());
        if let Err(why) = admitted {
            refused.log(format!("refused a connection of uid {uid}: {why}"));
            // One line, never waited on: the socket's buffer is empty.
            let _ = conn.set_nonblocking(true);
            let _ = (&conn).write_all(
                protocol::encode(&Response::Error {
                    message: format!("{why}; try again later"),
                })
                .as_bytes(),
            );
            continue;
        }
        let who = Peer { pid, uid, admin };
        let h = host.clone();
        let spawned = std::thread::Builder::new()
            .name("memtide-conn".into())
            .spawn(move || {
                connection(&conn, &h, who);
                h.gate().release(uid, admin, Instant::now());
            });
        if spawned.is_err() {
            host.gate().release(uid, admin, Instant::now());
        }
    }
    Ok(())
}

/// Who is at the other end of a connection.
#[derive(Clone, Copy)]
struct Peer {
    pid: u32,
    uid: u32,
    admin: bool,
}

/// Serves one connection until it closes or says nothing for [`HostConfig::silence`]; its
/// tenant, if any, leaves with it (one that stops reporting leaves at the next epoch).
fn connection(conn: &UnixStream, host: &Shared, who: Peer) {
    let silence = host.lock().cfg.silence;
    // A client that stops reading cannot hold this thread for long either.
    if conn.set_read_timeout(Some(silence)).is_err()
        || conn
            .set_write_timeout(Some(Duration::from_secs(10)))
            .is_err()
    {
        return;
    }
    let mut reader = BufReader::new(conn);
    let mut writer = conn;
    let mut mine: Option<u64> = None;
    let why = loop {
        let line = match protocol::read_line(&mut reader, protocol::MAX_REQUEST) {
            Ok(Some(line)) => line,
            Ok(None) => break "left",
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                break "went silent"
            }
            Err(_) => break "left",
        };
        let req = line.and_then(|l| protocol::decode(&l));
        let cost = match &req {
            Ok(Request::Register(_) | Request::Set(_)) => gate::CHANGE_COST,
            _ => 1.0,
        };
        let wait = host.gate().take(who.uid, who.admin, cost, Instant::now());
        if !wait.is_zero() {
            std::thread::sleep(wait);
        }
        let resp = match req {
            Err(e) => Response::Error {
                message: e.to_string(),
            },
            Ok(req) => answer(host, req, who, &mut mine),
        };
        if writer
            .write_all(protocol::encode(&resp).as_bytes())
            .is_err()
        {
            break "stopped reading";
        }
    };
    if let Some(id) = mine {
        host.lock().leave(id, why);
    }
}

fn answer(host: &Shared, req: Request, who: Peer, mine: &mut Option<u64>) -> Response {
    let err = |m: String| Response::Error { message: m };
    // /proc is read before the lock is taken: what the tenant's processes hold, and whether
    // the program it names is the connecting process or below it.
    let (usage, pid_ok) = match &req {
        Request::Register(r) if mine.is_none() => (
            procs::usage_of(who.pid),
            r.pid == who.pid || procs::descends_from(r.pid, who.pid),
        ),
        Request::Report(r) => (None, procs::descends_from(r.pid, who.pid)),
        _ => (None, false),
    };
    let mut h = host.lock();
    match req {
        Request::Register(r) => {
            if mine.is_some() {
                return err("this connection already registered a tenant".into());
            }
            match h.register(r, (who.uid, who.pid, who.admin), usage, pid_ok) {
                Ok(id) => {
                    *mine = Some(id);
                    Response::Registered {
                        tenant: id,
                        quota_bytes: h.tenants[&id].quota,
                        tier_dir: h.cfg.tier_dir.display().to_string(),
                        tier_bytes: h.tenants[&id].tier,
                        tier_capacity_bytes: h.cfg.tier_capacity_bytes,
                        encrypt_tier: h.cfg.encrypt_tier,
                        silence_seconds: h.cfg.silence.as_secs_f64(),
                    }
                }
                Err(m) => err(m),
            }
        }
        Request::Report(r) => match *mine {
            Some(id) => {
                if let Err(m) = r.check() {
                    return err(format!("report refused: {m}"));
                }
                match h.report(id, r, pid_ok) {
                    Some((quota_bytes, tier_bytes)) => Response::Quota {
                        quota_bytes,
                        tier_bytes: Some(tier_bytes),
                    },
                    None => {
                        *mine = None;
                        err(format!(
                            "tenant {id} is no longer registered (it stopped reporting): register again"
                        ))
                    }
                }
            }
            None => err("register first".into()),
        },
        Request::Status => {
            if who.admin {
                Response::Status(h.status(None))
            } else {
                // Someone else's tenant sees only itself (no tenant: the host totals alone).
                Response::Status(h.status(Some(mine.unwrap_or(0))))
            }
        }
        Request::Set(c) => {
            let target = match (c.tenant, *mine) {
                (Some(t), _) if who.admin => t,
                (Some(t), Some(m)) if t == m => t,
                (None, Some(m)) => m,
                (Some(t), _) => return err(format!("not allowed to change tenant {t}")),
                (None, None) => return err("which tenant? (this connection has none)".into()),
            };
            match h.change(target, &c) {
                Ok(()) => Response::Done,
                Err(m) => err(m),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MIB: u64 = 1 << 20;

    fn host(budget: u64) -> Host {
        Host::new(HostConfig {
            budget_bytes: budget,
            tier_dir: "/var/tmp".into(),
            tier_capacity_bytes: budget,
            socket: "/nonexistent".into(),
            group: None,
            epoch: Duration::from_secs(1),
            rules: ShareRules::default(),
            encrypt_tier: false,
            limits: gate::Limits::default(),
            silence: SILENCE,
            http_view: HttpView::Tenants,
        })
    }

    /// Registers a member's tenant from this process, whose figures nobody bounds yet.
    fn join(h: &mut Host, name: &str, min: u64, pinned: bool) -> Result<u64, String> {
        let me = std::process::id();
        h.register(
            Registration {
                name: name.into(),
                pid: me,
                min_bytes: min,
                max_bytes: None,
                pinned,
            },
            (1000, me, false),
            Some(procs::Usage::UNBOUNDED),
            true,
        )
    }

    /// The promises: quotas within the budget, every tiered tenant at or above its minimum.
    fn promises_hold(h: &Host) -> Result<(), String> {
        let s = h.status(None);
        let sum: u128 = s.tenants.iter().map(|t| t.quota_bytes as u128).sum();
        if sum > h.cfg.budget_bytes as u128 {
            return Err(format!(
                "quotas {sum} over the budget {}",
                h.cfg.budget_bytes
            ));
        }
        for t in &s.tenants {
            if t.quota_bytes < t.min_bytes {
                return Err(format!("tenant {} below its minimum", t.name));
            }
        }
        Ok(())
    }

    #[test]
    fn a_minimum_that_wraps_the_sum_is_refused() {
        let mut h = host(1 << 30);
        let a = join(&mut h, "a", 256 * MIB, false).unwrap();
        let taken = 256 * MIB;
        let wraps = u64::MAX - taken + 1 + 64 * 1024;
        let e = join(&mut h, "hostile", wraps, false).unwrap_err();
        assert!(e.contains("cannot guarantee"), "{e}");
        let b = join(&mut h, "b", 64 * MIB, false).unwrap();
        let e = h
            .change(
                b,
                &Change {
                    min_bytes: Some(wraps),
                    ..Change::default()
                },
            )
            .unwrap_err();
        assert!(e.contains("cannot guarantee"), "{e}");
        promises_hold(&h).unwrap();
        assert!(h.tenants[&a].quota >= 256 * MIB);
    }

    #[test]
    fn a_pinned_tenant_reserves_at_least_the_smallest_quota() {
        let mut h = host(1 << 30);
        let e = join(&mut h, "free ride", 0, true).unwrap_err();
        assert!(e.contains("pinned tenant's minimum"), "{e}");
        assert!(join(&mut h, "pinned", 64 * MIB, true).is_ok());
    }

    #[test]
    fn absurd_reports_are_refused_or_bounded_by_what_is_mapped() {
        let mut h = host(1 << 30);
        let honest = join(&mut h, "honest", 128 * MIB, false).unwrap();
        let liar = join(&mut h, "liar", 128 * MIB, false).unwrap();
        h.tenants.get_mut(&liar).unwrap().usage = Some(procs::Usage {
            mapped: 1 << 40,
            resident: 96 * MIB,
            tier_allocated: 32 * MIB,
            tier_length: 48 * MIB,
        });
        let busy = TenantReport {
            managed_bytes: 512 * MIB,
            dram_bytes: 128 * MIB,
            active_bytes: 400 * MIB,
            ..TenantReport::default()
        };
        h.report(honest, busy.clone(), true);
        h.report(honest, busy, true);
        let lie = TenantReport {
            managed_bytes: u64::MAX,
            dram_bytes: u64::MAX,
            tier_bytes: u64::MAX,
            tier_limit_bytes: u64::MAX,
            tier_file_bytes: u64::MAX,
            active_bytes: u64::MAX,
            pid: 1,
            ..TenantReport::default()
        };
        h.report(liar, lie.clone(), false);
        h.report(liar, lie, false);
        h.epoch(&[]);
        let t = &h.tenants[&liar];
        assert_eq!(t.report.managed_bytes, 1 << 40);
        assert_eq!(t.report.dram_bytes, 96 * MIB);
        assert_eq!(t.report.tier_bytes, 32 * MIB);
        assert_eq!(t.report.active_bytes, 128 * MIB, "resident + in the tier");
        assert_eq!(t.report.tier_file_bytes, 48 * MIB);
        assert!(t.report.tier_limit_bytes <= t.tier_granted);
        // pid 1 does not descend from this process: the pid stays the connecting one's.
        assert_eq!(t.pid, std::process::id());
        promises_hold(&h).unwrap();
        // The honest tenant, active over 400 MiB, gets at least as much as the liar.
        assert!(
            h.tenants[&honest].quota >= h.tenants[&liar].quota,
            "honest {} liar {}",
            h.tenants[&honest].quota,
            h.tenants[&liar].quota
        );
        let mut r = TenantReport {
            tier_reads: 10,
            tier_read_latency_buckets: vec![(1.0, 1); MAX_BUCKETS_PLUS_ONE],
            ..TenantReport::default()
        };
        assert!(r.check().unwrap_err().contains("latency buckets"));
        r.tier_read_latency_buckets = vec![(100.0, 5), (50.0, 6)];
        assert!(r.check().is_err());
        r.tier_read_latency_buckets = vec![(100.0, 5), (200.0, 11)];
        assert!(r.check().is_err());
        r.tier_read_latency_buckets = vec![(100.0, 5), (200.0, 10)];
        r.tier_read_latency_p99_us = f64::NAN;
        assert!(r.check().is_err());
        r.tier_read_latency_p99_us = 150.0;
        assert!(r.check().is_ok());
    }

    const MAX_BUCKETS_PLUS_ONE: usize = protocol::MAX_LATENCY_BUCKETS + 1;

    #[test]
    fn a_tenant_that_stops_reporting_leaves_at_the_epoch() {
        let mut h = host(1 << 30);
        h.cfg.silence = Duration::from_millis(50);
        let quiet = join(&mut h, "quiet", 256 * MIB, false).unwrap();
        let busy = join(&mut h, "busy", 64 * MIB, false).unwrap();
        std::thread::sleep(Duration::from_millis(80));
        assert!(h.report(busy, TenantReport::default(), true).is_some());
        h.epoch(&[]);
        assert!(
            !h.tenants.contains_key(&quiet),
            "its minimum is held for nothing"
        );
        assert!(h.tenants.contains_key(&busy));
        assert_eq!(h.guaranteed(None), 64 * MIB);
        // Its connection's next report is told, not answered with a quota of nothing.
        assert!(h.report(quiet, TenantReport::default(), true).is_none());
    }

    #[test]
    fn a_member_out_of_sight_in_proc_is_refused_and_a_gone_one_claims_nothing() {
        let mut h = host(1 << 30);
        let r = Registration {
            name: "hidden".into(),
            pid: 0,
            min_bytes: 64 * MIB,
            max_bytes: None,
            pinned: false,
        };
        let e = h
            .register(r.clone(), (1000, 0, false), None, false)
            .unwrap_err();
        assert!(e.contains("/proc"), "{e}");
        // An admin's is taken, unbounded.
        assert!(h.register(r, (0, 0, true), None, false).is_ok());
        let gone = join(&mut h, "gone", 64 * MIB, false).unwrap();
        let peer = h.tenants[&gone].peer;
        h.epoch(&[(peer, None)]);
        let big = TenantReport {
            managed_bytes: 1 << 30,
            active_bytes: 1 << 30,
            ..TenantReport::default()
        };
        h.report(gone, big, true).unwrap();
        assert_eq!(h.tenants[&gone].report.active_bytes, 0);
    }

    #[test]
    fn names_keep_no_control_characters() {
        let mut h = host(1 << 30);
        let id = join(
            &mut h,
            "evil\x1b[2J\x1b]0;owned\x07\nmemtide host: forged",
            64 * MIB,
            false,
        )
        .unwrap();
        let name = &h.tenants[&id].name;
        assert!(!name.chars().any(char::is_control), "{name:?}");
        assert!(name.starts_with("evil\\u{1b}[2J"), "{name:?}");
    }

    #[derive(Clone, Debug)]
    enum Op {
        Join(u64, bool),
        Set(usize, Option<u64>, Option<u64>),
        Report(usize, u64, u64, u64),
        Leave(usize),
    }

    /// Numbers a hostile tenant would pick: near 0, near the budget, near the top of u64.
    fn number() -> impl Strategy<Value = u64> {
        prop_oneof![
            0..(4u64 << 30),
            (0..(1u64 << 20)).prop_map(|d| u64::MAX - d),
            (0..(1u64 << 30)).prop_map(|d| (1u64 << 63).wrapping_sub(d)),
            any::<u64>(),
        ]
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (number(), any::<bool>()).prop_map(|(m, p)| Op::Join(m, p)),
            (
                0..8usize,
                proptest::option::of(number()),
                proptest::option::of(number())
            )
                .prop_map(|(i, a, b)| Op::Set(i, a, b)),
            (0..8usize, number(), number(), number())
                .prop_map(|(i, a, b, c)| Op::Report(i, a, b, c)),
            (0..8usize).prop_map(Op::Leave),
        ]
    }

    proptest! {
        /// Whatever numbers tenants send (terms, reports), the quotas stay within the budget
        /// and no tiered tenant drops below its minimum.
        #[test]
        fn no_numbers_break_the_promises(ops in prop::collection::vec(op(), 1..40)) {
            let mut h = host(1 << 30);
            let mut ids = Vec::new();
            for o in ops {
                match o {
                    Op::Join(min, pinned) => {
                        if let Ok(id) = join(&mut h, "t", min, pinned) {
                            ids.push(id);
                        }
                    }
                    Op::Set(i, min, max) => {
                        if let Some(&id) = ids.get(i) {
                            let _ = h.change(id, &Change { tenant: None, min_bytes: min, max_bytes: max });
                        }
                    }
                    Op::Report(i, managed, active, tier) => {
                        if let Some(&id) = ids.get(i) {
                            let r = TenantReport {
                                managed_bytes: managed,
                                active_bytes: active,
                                dram_bytes: active,
                                tier_bytes: tier,
                                tier_limit_bytes: tier,
                                ..TenantReport::default()
                            };
                            if r.check().is_ok() {
                                h.report(id, r, true);
                            }
                        }
                    }
                    Op::Leave(i) => {
                        if i < ids.len() {
                            h.leave(ids.remove(i), "left");
                        }
                    }
                }
                h.epoch(&[]);
                prop_assert!(promises_hold(&h).is_ok(), "{:?}", promises_hold(&h));
            }
        }
    }
}
