//! What tenants and admin clients say to the host daemon: one JSON object per line over its
//! Unix socket, each answered by one line. A request longer than [`MAX_REQUEST`], one that does
//! not decode, or a report whose numbers cannot be true ([`TenantReport::check`]) gets an error
//! reply and never ends the daemon. Entry points: [`Request`], [`Response`], [`read_line`],
//! [`decode`].

use std::io::{self, BufRead};

use memtide_engine::Snapshot;
use serde::{Deserialize, Serialize};

/// Longest request the daemon reads: a report with every latency bucket takes about 2 KiB.
pub const MAX_REQUEST: usize = 64 << 10;

/// Longest answer a client reads: the status of the most tenants a daemon admits, each with
/// the longest name and every latency bucket, fits several times over.
pub const MAX_ANSWER: usize = 64 << 20;

/// Most tier-read latency buckets a report may carry (the engine sends 11).
pub const MAX_LATENCY_BUCKETS: usize = 64;

/// Longest tenant name, in bytes, as sent (before [`printable`] writes out what it hides).
pub const MAX_NAME: usize = 200;

/// A client's request.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Makes the connection's program a tenant. Its share is released when the connection
    /// closes.
    Register(Registration),
    /// The tenant's figures now; answered with its quota.
    Report(TenantReport),
    /// The host and its tenants (a tenant sees only itself).
    Status,
    /// Changes a tenant's minimum, maximum or pinning (a tenant may change only itself).
    Set(Change),
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Registration {
    pub name: String,
    /// The program's process (for status; the daemon trusts the socket's credentials, not
    /// this, for who may do what).
    pub pid: u32,
    /// Guaranteed DRAM (for a pinned tenant: its reservation).
    pub min_bytes: u64,
    #[serde(default)]
    pub max_bytes: Option<u64>,
    /// Never tiered: the program runs without memtide and is charged `min_bytes`.
    #[serde(default)]
    pub pinned: bool,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Change {
    /// The tenant to change (default: the connection's own).
    #[serde(default)]
    pub tenant: Option<u64>,
    #[serde(default)]
    pub min_bytes: Option<u64>,
    /// `Some(0)` removes the maximum.
    #[serde(default)]
    pub max_bytes: Option<u64>,
}

/// A tenant's figures, summed over its processes.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct TenantReport {
    /// The program's process (0: not known yet).
    #[serde(default)]
    pub pid: u32,
    pub dram_bytes: u64,
    pub tier_bytes: u64,
    /// The most its tier may hold now.
    #[serde(default)]
    pub tier_limit_bytes: u64,
    /// How long its tier files are (after a lowered limit, longer than the limit until what
    /// lay above it has moved below).
    #[serde(default)]
    pub tier_file_bytes: u64,
    pub managed_bytes: u64,
    pub active_bytes: u64,
    /// The compressed level: pages it holds (uncompressed bytes) and the DRAM its pool takes
    /// (part of `dram_bytes`).
    #[serde(default)]
    pub compressed_bytes: u64,
    #[serde(default)]
    pub compressed_pool_bytes: u64,
    pub faults_zero: u64,
    /// Faults served from below DRAM, both levels; of those, from the compressed pool.
    pub faults_tier: u64,
    #[serde(default)]
    pub faults_compressed: u64,
    pub faults_inactive: u64,
    pub faults_wait: u64,
    pub promotions: u64,
    pub demotions: u64,
    pub tier_read_bytes: u64,
    pub tier_write_bytes: u64,
    /// Cumulative tier-read counts at upper bounds in microseconds.
    pub tier_read_latency_buckets: Vec<(f64, u64)>,
    pub tier_read_latency_sum_us: f64,
    pub tier_reads: u64,
    pub tier_read_latency_p50_us: f64,
    pub tier_read_latency_p99_us: f64,
}

impl TenantReport {
    /// The figures of a tenant's processes, summed (latency quantiles: the worst process's).
    /// What a process holds counts while it runs (`alive`); what it did counts for good, so
    /// that the tenant's counts never go back when one of its processes ends.
    pub fn of<'a>(
        snaps: impl IntoIterator<Item = &'a Snapshot>,
        alive: impl Fn(u32) -> bool,
    ) -> TenantReport {
        let mut r = TenantReport::default();
        for s in snaps {
            if alive(s.pid) {
                r.dram_bytes += s.dram_bytes;
                r.tier_bytes += s.tier_bytes;
                r.tier_limit_bytes += s.tier_limit_bytes;
                r.tier_file_bytes += s.tier_file_bytes;
                r.managed_bytes += s.managed_bytes;
                r.active_bytes += s.active_bytes;
                r.compressed_bytes += s.compressed_pages * 4096;
                r.compressed_pool_bytes += s.compressed_pool_bytes;
            }
            r.faults_zero += s.faults_zero;
            r.faults_tier += s.faults_tier;
            r.faults_compressed += s.faults_compressed;
            r.faults_inactive += s.faults_inactive;
            r.faults_wait += s.faults_wait;
            r.promotions += s.promotions;
            r.demotions += s.demotions;
            r.tier_read_bytes += s.tier_read_bytes;
            r.tier_write_bytes += s.tier_write_bytes;
            if r.tier_read_latency_buckets.is_empty() {
                r.tier_read_latency_buckets = s.tier_read_latency_buckets.clone();
            } else {
                for (b, &(le, n)) in r
                    .tier_read_latency_buckets
                    .iter_mut()
                    .zip(&s.tier_read_latency_buckets)
                {
                    if b.0 == le {
                        b.1 += n;
                    }
                }
            }
            r.tier_read_latency_sum_us += s.tier_read_latency_sum_us;
            r.tier_reads += s.tier_reads;
            r.tier_read_latency_p50_us = r.tier_read_latency_p50_us.max(s.tier_read_latency_p50_us);
            r.tier_read_latency_p99_us = r.tier_read_latency_p99_us.max(s.tier_read_latency_p99_us);
        }
        r
    }
}

impl TenantReport {
    /// Whether the numbers can come from a real engine: every float finite and not negative,
    /// at most [`MAX_LATENCY_BUCKETS`] latency buckets with rising bounds and cumulative
    /// counts that never fall and never pass the reads. A report that fails is refused whole
    /// (the daemon keeps the one before).
    pub fn check(&self) -> Result<(), String> {
        for (what, v) in [
            ("tier_read_latency_sum_us", self.tier_read_latency_sum_us),
            ("tier_read_latency_p50_us", self.tier_read_latency_p50_us),
            ("tier_read_latency_p99_us", self.tier_read_latency_p99_us),
        ] {
            if !v.is_finite() || v < 0.0 {
                return Err(format!("{what} must be a number of at least 0, not {v}"));
            }
        }
        let b = &self.tier_read_latency_buckets;
        if b.len() > MAX_LATENCY_BUCKETS {
            return Err(format!(
                "{} latency buckets: at most {MAX_LATENCY_BUCKETS}",
                b.len()
            ));
        }
        let mut below = (0.0, 0u64);
        for &(le, n) in b {
            if !le.is_finite() || le <= below.0 || n < below.1 || n > self.tier_reads {
                return Err(
                    "latency buckets must have rising bounds and cumulative counts within the reads"
                        .into(),
                );
            }
            below = (le, n);
        }
        Ok(())
    }

    /// Bounds the figures by what the daemon knows without the tenant's word (`b`) and by one
    /// another: nothing is in DRAM or the tier beyond what is managed, and a page is active
    /// only where it is, in DRAM or in the tier.
    pub fn bound(&mut self, b: &Bounds) {
        self.managed_bytes = self.managed_bytes.min(b.managed);
        let m = self.managed_bytes;
        self.dram_bytes = self.dram_bytes.min(m).min(b.dram);
        self.tier_bytes = self.tier_bytes.min(m).min(b.tier);
        self.active_bytes = self.active_bytes.min(m).min(b.dram.saturating_add(b.tier));
        self.tier_limit_bytes = self.tier_limit_bytes.min(b.tier_limit);
        self.tier_file_bytes = self.tier_file_bytes.min(b.tier_file);
    }
}

/// The most each figure of a tenant's report can be, from what the daemon knows without its
/// word (/proc, and the tier shares it gave).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bounds {
    pub managed: u64,
    pub dram: u64,
    pub tier: u64,
    pub tier_limit: u64,
    pub tier_file: u64,
}

/// `name` with every control and invisible formatting character written out (`\u{1b}`,
/// `\u{202e}`) and backslashes doubled, so that printing it to a terminal or a log cannot
/// move the cursor, change colours, reorder text or forge a line, nor pass for an escape.
pub fn printable(name: &str) -> String {
    let hidden = |c: char| {
        c.is_control()
            || matches!(c, '\u{ad}' | '\u{61c}' | '\u{180e}' | '\u{feff}')
            || ('\u{200b}'..='\u{200f}').contains(&c)
            || ('\u{202a}'..='\u{202e}').contains(&c)
            || ('\u{2060}'..='\u{206f}').contains(&c)
            || ('\u{fff9}'..='\u{fffb}').contains(&c)
    };
    name.chars()
        .map(|c| {
            if c == '\\' {
                "\\\\".to_string()
            } else if hidden(c) {
                c.escape_unicode().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// The latency at quantile `q` (0..1) of the tier reads between two reports (`before` may be
/// empty: since the start), in microseconds, interpolated within the bucket as Prometheus's
/// `histogram_quantile` does; `None` without reads in between. Reads slower than the last
/// bound count as the last bound.
pub fn window_quantile_us(
    now: &TenantReport,
    before: Option<&TenantReport>,
    q: f64,
) -> Option<f64> {
    let at = |r: Option<&TenantReport>, i: usize| -> u64 {
        r.and_then(|r| r.tier_read_latency_buckets.get(i))
            .map_or(0, |b| b.1)
    };
    let total = now
        .tier_reads
        .saturating_sub(before.map_or(0, |b| b.tier_reads));
    if total == 0 || now.tier_read_latency_buckets.is_empty() {
        return None;
    }
    let rank = q * total as f64;
    let mut lower = (0.0, 0u64);
    for (i, &(le, _)) in now.tier_read_latency_buckets.iter().enumerate() {
        let cum = at(Some(now), i).saturating_sub(at(before, i));
        if cum as f64 >= rank {
            let in_bucket = (cum - lower.1) as f64;
            let frac = if in_bucket > 0.0 {
                (rank - lower.1 as f64) / in_bucket
            } else {
                1.0
            };
            return Some(lower.0 + (le - lower.0) * frac.clamp(0.0, 1.0));
        }
        lower = (le, cum);
    }
    Some(lower.0)
}

/// The daemon's answer.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "snake_case")]
pub enum Response {
    Registered {
        tenant: u64,
        quota_bytes: u64,
        /// Where the tenant's tier file goes, and the most it may hold now (its share of the
        /// host's tier capacity, which later `Quota` answers change).
        tier_dir: String,
        tier_bytes: u64,
        /// The host's tier capacity: the most a share can grow to.
        #[serde(default)]
        tier_capacity_bytes: u64,
        /// The host encrypts every tenant's tier pages.
        #[serde(default)]
        encrypt_tier: bool,
        /// A tenant that sends no report for this long leaves (0: not said).
        #[serde(default)]
        silence_seconds: f64,
    },
    Quota {
        quota_bytes: u64,
        /// The tenant's share of the host's tier capacity (`None`: the daemon does not share
        /// it; keep the size registered with).
        #[serde(default)]
        tier_bytes: Option<u64>,
    },
    Status(HostStatus),
    Done,
    Error {
        message: String,
    },
}

/// The host as `memtide status` shows it.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct HostStatus {
    pub budget_bytes: u64,
    pub tier_dir: String,
    pub tier_capacity_bytes: u64,
    /// Sums over the tenants.
    pub quota_bytes: u64,
    pub dram_bytes: u64,
    pub tier_bytes: u64,
    pub active_bytes: u64,
    /// Health of active memory against the budget, and of tier-read latency (the worst
    /// tenant's, over the last report interval).
    pub active_health: String,
    pub tier_read_latency_p50_us: f64,
    pub tier_read_latency_p99_us: f64,
    pub latency_health: String,
    pub uptime_seconds: f64,
    pub tenants: Vec<TenantStatus>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct TenantStatus {
    pub tenant: u64,
    pub name: String,
    pub pid: u32,
    pub uid: u32,
    pub pinned: bool,
    pub min_bytes: u64,
    pub max_bytes: Option<u64>,
    pub quota_bytes: u64,
    /// Its share of the host's tier capacity.
    #[serde(default)]
    pub tier_share_bytes: u64,
    /// Active memory as a share of the quota, and its colour.
    pub active_pct: f64,
    pub health: String,
    /// Per second, over the last report interval.
    pub faults_per_second: f64,
    pub tier_faults_per_second: f64,
    pub promotions_per_second: f64,
    /// Tier-read latency over the last report interval (0 without reads).
    pub recent_read_p50_us: f64,
    pub recent_read_p99_us: f64,
    pub seconds: f64,
    pub report: TenantReport,
}

/// Why a line was not a request.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("message longer than {0} bytes")]
    TooLong(usize),
    #[error("message is not UTF-8")]
    NotUtf8,
    #[error("malformed message: {0}")]
    Malformed(String),
}

/// Reads one line of at most `limit` bytes (without its newline). `Ok(None)` at the end of the
/// stream. A longer line is consumed to its end and reported as [`DecodeError::TooLong`] (as
/// `Ok(Some(Err(..)))`), so the connection can go on.
pub fn read_line(
    r: &mut impl BufRead,
    limit: usize,
) -> io::Result<Option<Result<String, DecodeError>>> {
    let mut buf = Vec::new();
    let mut too_long = false;
    loop {
        let chunk = r.fill_buf()?;
        if chunk.is_empty() {
            if buf.is_empty() && !too_long {
                return Ok(None);
            }
            break;
        }
        let (part, done) = match chunk.iter().position(|&b| b == b'\n') {
            Some(i) => (&chunk[..i], Some(i + 1)),
            None => (chunk, None),
        };
        if !too_long {
            if buf.len() + part.len() > limit {
                too_long = true;
                buf = Vec::new();
            } else {
                buf.extend_from_slice(part);
            }
        }
        let used = done.unwrap_or(chunk.len());
        r.consume(used);
        if done.is_some() {
            break;
        }
    }
    if too_long {
        return Ok(Some(Err(DecodeError::TooLong(limit))));
    }
    Ok(Some(
        String::from_utf8(buf).map_err(|_| DecodeError::NotUtf8),
    ))
}

/// Decodes a request line.
pub fn decode(line: &str) -> Result<Request, DecodeError> {
    serde_json::from_str(line).map_err(|e| DecodeError::Malformed(e.to_string()))
}

/// One line to send.
pub fn encode<T: Serialize>(msg: &T) -> String {
    let mut s = serde_json::to_string(msg).unwrap_or_else(|e| {
        serde_json::to_string(&Response::Error {
            message: e.to_string(),
        })
        .unwrap_or_default()
    });
    s.push('\n');
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn requests_round_trip() {
        for r in [
            Request::Register(Registration {
                name: "redis".into(),
                pid: 7,
                min_bytes: 1 << 30,
                max_bytes: None,
                pinned: false,
            }),
            Request::Report(TenantReport::default()),
            Request::Status,
            Request::Set(Change {
                tenant: Some(3),
                min_bytes: Some(5),
                max_bytes: None,
            }),
        ] {
            let line = encode(&r);
            assert!(line.ends_with('\n'));
            assert_eq!(decode(line.trim_end()).unwrap(), r);
        }
    }

    #[test]
    fn window_quantiles_interpolate_within_buckets() {
        let mut before = TenantReport {
            tier_reads: 100,
            tier_read_latency_buckets: vec![(100.0, 100), (200.0, 100), (400.0, 100)],
            ..TenantReport::default()
        };
        let now = TenantReport {
            tier_reads: 300,
            tier_read_latency_buckets: vec![(100.0, 100), (200.0, 200), (400.0, 300)],
            ..TenantReport::default()
        };
        // Since `before`: 100 reads in (100, 200], 100 in (200, 400].
        assert_eq!(window_quantile_us(&now, Some(&before), 0.5), Some(200.0));
        assert_eq!(window_quantile_us(&now, Some(&before), 0.75), Some(300.0));
        // Since the start: a third below 100 µs.
        assert_eq!(window_quantile_us(&now, None, 0.25), Some(75.0));
        before.tier_reads = 300;
        assert_eq!(window_quantile_us(&now, Some(&now), 0.5), None);
    }

    #[test]
    fn names_print_as_what_they_are() {
        assert_eq!(printable("redis-6379"), "redis-6379");
        assert_eq!(printable("a\x1b[2Jb\n"), "a\\u{1b}[2Jb\\u{a}");
        // Right-to-left override, zero-width space: shown, not obeyed.
        assert_eq!(printable("x\u{202e}y\u{200b}"), "x\\u{202e}y\\u{200b}");
        // A name that spells an escape cannot pass for one.
        assert_eq!(printable("a\\u{1b}"), "a\\\\u{1b}");
        assert_eq!(printable("ünïcödé 名前"), "ünïcödé 名前");
    }

    #[test]
    fn long_lines_are_refused_and_the_stream_goes_on() {
        let mut input = vec![b'x'; MAX_REQUEST + 10];
        input.push(b'\n');
        input.extend_from_slice(b"\"status\"\n");
        let mut r = io::BufReader::with_capacity(4096, &input[..]);
        assert!(matches!(
            read_line(&mut r, MAX_REQUEST).unwrap(),
            Some(Err(DecodeError::TooLong(MAX_REQUEST)))
        ));
        let next = read_line(&mut r, MAX_REQUEST).unwrap().unwrap().unwrap();
        assert_eq!(decode(&next).unwrap(), Request::Status);
        assert!(read_line(&mut r, MAX_REQUEST).unwrap().is_none());
    }

    proptest! {
        /// The decoder takes any bytes without panicking: each line decodes or is an error.
        #[test]
        fn decoder_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..2048)) {
            let mut r = io::BufReader::with_capacity(64, &bytes[..]);
            let mut lines = 0;
            while let Some(line) = read_line(&mut r, MAX_REQUEST).unwrap() {
                if let Ok(l) = line {
                    let _ = decode(&l);
                }
                lines += 1;
                prop_assert!(lines <= bytes.len() + 1);
            }
        }

        /// Reports with any numbers: one that passes the check yields latency quantiles that
        /// are numbers within its buckets' bounds, and bounding it never leaves a figure above
        /// what it manages.
        #[test]
        fn a_report_that_passes_the_check_means_something(
            reads in any::<u64>(),
            junk in prop::collection::vec((-1e9f64..1e12, any::<u64>()), 0..80),
            steps in prop::collection::vec((0.1f64..1e4, 0u64..1000), 0..70),
            sum in prop_oneof![Just(f64::NAN), Just(f64::INFINITY), -1e9f64..1e12],
            figures in prop::array::uniform5(any::<u64>()),
            q in 0.0f64..=1.0,
        ) {
            // Half the time, buckets that rise (as an engine's do), maybe too many.
            let buckets = if reads % 2 == 0 {
                junk
            } else {
                steps
                    .iter()
                    .scan((0.0, 0u64), |at, &(dl, dn)| {
                        *at = (at.0 + dl, at.1 + dn);
                        Some(*at)
                    })
                    .collect()
            };
            let reads = if reads % 2 == 0 {
                reads
            } else {
                buckets.last().map_or(0, |b: &(f64, u64)| b.1) + reads % 1000
            };
            let mut r = TenantReport {
                tier_reads: reads,
                tier_read_latency_buckets: buckets,
                tier_read_latency_sum_us: sum,
                managed_bytes: figures[0],
                dram_bytes: figures[1],
                active_bytes: figures[2],
                tier_bytes: figures[3],
                tier_limit_bytes: figures[4],
                ..TenantReport::default()
            };
            if r.check().is_ok() {
                prop_assert!(r.tier_read_latency_buckets.len() <= MAX_LATENCY_BUCKETS);
                let top = r.tier_read_latency_buckets.last().map_or(0.0, |b| b.0);
                if let Some(us) = window_quantile_us(&r, None, q) {
                    prop_assert!(us.is_finite() && (0.0..=top).contains(&us), "{us} beyond {top}");
                }
            }
            let b = Bounds {
                managed: figures[0] / 2,
                dram: figures[1] / 3,
                tier: figures[3] / 3,
                tier_limit: 1 << 40,
                tier_file: 1 << 41,
            };
            r.bound(&b);
            prop_assert!(r.managed_bytes <= b.managed);
            for v in [r.dram_bytes, r.active_bytes, r.tier_bytes] {
                prop_assert!(v <= r.managed_bytes);
            }
            prop_assert!(r.dram_bytes <= b.dram && r.tier_bytes <= b.tier);
            prop_assert!(r.active_bytes <= b.dram + b.tier);
            prop_assert!(r.tier_limit_bytes <= b.tier_limit && r.tier_file_bytes <= b.tier_file);
        }

        /// JSON-shaped junk: valid JSON that is not a request is refused, not taken.
        #[test]
        fn json_that_is_not_a_request_is_refused(
            key in "[a-z_]{1,12}",
            n in any::<i64>(),
        ) {
            prop_assume!(!["register", "report", "status", "set"].contains(&key.as_str()));
            let line = format!("{{\"{key}\": {n}}}");
            prop_assert!(decode(&line).is_err());
        }
    }
}
