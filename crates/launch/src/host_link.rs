//! The program's link to the host daemon (`memtide run --host`): registers it as a tenant,
//! reports its figures every interval and hands back the quota and tier share in force,
//! keeping the last ones while the daemon is away and registering again when it returns.
//! Entry points: [`HostLink`], [`pinned_report`].

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use memtide_engine::size::format as bytes;
use memtide_host::client::Client;
use memtide_host::protocol::{Registration, Request, Response, TenantReport};

/// The tenant's connection to the host daemon: registers, reports, and keeps the last quota
/// when the daemon goes away (registering again when it returns).
pub struct HostLink {
    socket: PathBuf,
    registration: Registration,
    client: Option<Client>,
    quota: u64,
    /// The tenant's share of the host's tier capacity, as last heard.
    tier: u64,
    tenant: u64,
    /// Set once the loss of the daemon has been reported (until it is back).
    lost: bool,
}

/// What the daemon grants a tenant that registers.
pub struct Grant {
    pub tenant: u64,
    pub quota_bytes: u64,
    pub tier_dir: String,
    pub tier_bytes: u64,
    pub tier_capacity_bytes: u64,
    pub encrypt_tier: bool,
    /// The daemon lets go of a tenant that sends no report for this long (0: not said).
    pub silence_seconds: f64,
}

/// Connects to the daemon at `socket` and registers `registration`.
fn register_at(socket: &Path, registration: &Registration) -> Result<(Client, Grant)> {
    let mut client = Client::connect(socket)?;
    match client.call(&Request::Register(registration.clone()))? {
        Response::Registered {
            tenant,
            quota_bytes,
            tier_dir,
            tier_bytes,
            tier_capacity_bytes,
            encrypt_tier,
            silence_seconds,
        } => Ok((
            client,
            Grant {
                tenant,
                quota_bytes,
                tier_dir,
                tier_bytes,
                tier_capacity_bytes,
                encrypt_tier,
                silence_seconds,
            },
        )),
        other => bail!("the host daemon answered {other:?} to a registration"),
    }
}

impl HostLink {
    /// The tenant number the daemon gave the program (the latest, after a re-registration).
    pub fn tenant(&self) -> u64 {
        self.tenant
    }

    /// The quota in force: the latest the daemon gave, kept while it is away.
    pub fn quota(&self) -> u64 {
        self.quota
    }

    pub fn register(socket: &Path, registration: Registration) -> Result<(HostLink, Grant)> {
        let (client, grant) = register_at(socket, &registration)?;
        Ok((
            HostLink {
                socket: socket.to_path_buf(),
                registration,
                client: Some(client),
                quota: grant.quota_bytes,
                tier: grant.tier_bytes,
                tenant: grant.tenant,
                lost: false,
            },
            grant,
        ))
    }

    /// Sends `report`; returns the quota and tier share in force (the last ones known if the
    /// daemon is away).
    pub fn report(&mut self, report: &TenantReport) -> (u64, u64) {
        if self.client.is_none() {
            if let Ok((c, grant)) = register_at(&self.socket, &self.registration) {
                eprintln!(
                    "memtide: the host daemon is back; registered again as tenant {} (quota {})",
                    grant.tenant,
                    bytes(grant.quota_bytes)
                );
                self.client = Some(c);
                self.tenant = grant.tenant;
                self.quota = grant.quota_bytes;
                self.tier = grant.tier_bytes;
                self.lost = false;
            }
        }
        if let Some(c) = &mut self.client {
            match c.call(&Request::Report(report.clone())) {
                Ok(Response::Quota {
                    quota_bytes,
                    tier_bytes,
                }) => {
                    self.quota = quota_bytes;
                    if let Some(t) = tier_bytes {
                        self.tier = t;
                    }
                }
                Ok(_) | Err(_) => {
                    self.client = None;
                    if !self.lost {
                        self.lost = true;
                        eprintln!(
                            "memtide: lost the host daemon at {}; keeping the quota of {} until it is back",
                            self.socket.display(),
                            bytes(self.quota)
                        );
                    }
                }
            }
        }
        (self.quota, self.tier)
    }
}

/// The pinned program's figures: it runs without memtide, so its resident memory is all DRAM.
pub fn pinned_report(pid: u32) -> TenantReport {
    let rss = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .unwrap_or(0)
        * 1024;
    TenantReport {
        dram_bytes: rss,
        managed_bytes: rss,
        ..TenantReport::default()
    }
}
