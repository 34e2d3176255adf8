//! The key-value experiments of `memtide bench`: memcached and redis (Debian's) holding a
//! dataset of values, driven over loopback by memtide's own load generator — zipf-distributed
//! keys, 90% gets and 10% sets, several connections, every get's value checked — under every
//! configuration (all-DRAM, memtide, Linux swap, zswap), interleaved, medians of the
//! repetitions. Entry point: [`run`].

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use memtide_engine::launch::{die_with_parent, StatsDir};
use memtide_sim::workload::{scatter_stride, Rng, Zipf};
use serde::Serialize;

use crate::demo::Placement;
use crate::lab::{beyond_quota, config_width, swap_peer, Common, Configs, SameDram};
use crate::report::median;
use crate::summary;
use crate::system::{interrupted, Pools};

/// The key-value experiments' flags (`memcached`, `redis`).
#[derive(clap::Args, Debug)]
pub struct KvArgs {
    /// Key popularity skews (zipf) for memcached and redis.
    #[arg(long, value_delimiter = ',', default_value = "0.99,0.8")]
    pub skews: Vec<f64>,
    /// Client connections driving memcached and redis.
    #[arg(long, default_value_t = 4)]
    pub clients: usize,
    /// Bytes per value for memcached and redis.
    #[arg(long, default_value_t = 4000)]
    pub value_bytes: usize,
    /// What the values hold: `letters` (random lowercase letters: lz4 finds nothing to
    /// shrink), `text` (English words), `json` (JSON records of a user table). Every get is
    /// checked against it.
    #[arg(long, value_enum, default_value = "letters")]
    pub values: Values,
    /// redis only: measure while redis saves a snapshot (BGSAVE, which forks; the child
    /// writes the dump while the parent serves). The measured window is the save; the table
    /// adds its duration and the peak DRAM of the pair (the sum of their Pss_Anon, sampled
    /// every 50 ms).
    #[arg(long)]
    pub bgsave: bool,
}

impl KvArgs {
    /// Refuses skews, connections and value sizes it cannot run.
    pub fn check(&self) -> Result<()> {
        if self.skews.iter().any(|s| !(*s > 0.0 && *s < 4.0)) {
            bail!("--skews: give zipf skews between 0 and 4, like 0.99,0.8");
        }
        if self.clients == 0 || self.clients > 256 {
            bail!("--clients: give 1 to 256 connections");
        }
        if !(16..=1 << 20).contains(&self.value_bytes) {
            bail!("--value-bytes: give 16 bytes to 1 MiB");
        }
        Ok(())
    }

    /// Refuses `--bgsave` for a server that has no such thing.
    pub fn check_server(&self, server: Server) -> Result<()> {
        if self.bgsave && server != Server::Redis {
            bail!("--bgsave: only redis saves snapshots; run the redis experiment");
        }
        Ok(())
    }
}

/// Which server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Server {
    Memcached,
    Redis,
}

impl Server {
    pub fn from_name(s: &str) -> Option<Server> {
        match s {
            "memcached" => Some(Server::Memcached),
            "redis" => Some(Server::Redis),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Server::Memcached => "memcached",
            Server::Redis => "redis",
        }
    }

    fn program(self) -> &'static str {
        match self {
            Server::Memcached => "memcached",
            Server::Redis => "redis-server",
        }
    }

    /// Fails with the command that installs the server when it is missing.
    pub fn check_installed(self) -> Result<()> {
        let ok = Command::new("sh")
            .arg("-c")
            .arg(format!("command -v {}", self.program()))
            .output()
            .is_ok_and(|o| o.status.success());
        if !ok {
            bail!(
                "{} is not installed: run `apt-get install {}` (as root)",
                self.program(),
                match self {
                    Server::Memcached => "memcached",
                    Server::Redis => "redis-server",
                }
            );
        }
        Ok(())
    }

    fn command(self, port: u16, dataset: u64, keys: u64, dir: &Path) -> Command {
        let mut c = Command::new(self.program());
        match self {
            Server::Memcached => {
                // Room for the whole dataset with its item overhead: nothing is evicted.
                let mib = ((dataset * 2) >> 20).max(64);
                c.args(["-p", &port.to_string(), "-U", "0", "-l", "127.0.0.1"])
                    .args(["-t", "2", "-c", "1024", "-u", "root"])
                    .args(["-m", &mib.to_string()])
                    .args(["-o", &format!("hashpower={}", memcached_hashpower(keys))]);
            }
            Server::Redis => {
                c.args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                    .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
                    .arg("--dir")
                    .arg(dir);
            }
        }
        c.stdout(Stdio::null()).stderr(Stdio::null());
        c
    }
}

/// memcached's hash table size (log2 of buckets) for `keys` items, as its documentation
/// advises for a known item count: big enough that the table never grows while the bench
/// runs. (Growing it, memcached's maintenance thread rehashes every item, touching all of its
/// memory: under any tiering that reads the whole dataset back from the device and pushes
/// the hot items out. The setting is the same for every configuration.)
fn memcached_hashpower(keys: u64) -> u32 {
    // memcached grows the table past 1.5 items per bucket; stay under 1.
    (keys.max(1).next_power_of_two().trailing_zeros()).clamp(16, 32)
}

/// What the values hold, named by what they look like.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Values {
    /// Random lowercase letters.
    #[default]
    Letters,
    /// English words separated by spaces, as text stored in a cache.
    Text,
    /// JSON records of a user table: ids, names, e-mail addresses, flags, timestamps.
    Json,
}

impl Values {
    pub fn name(self) -> &'static str {
        match self {
            Values::Letters => "letters",
            Values::Text => "text",
            Values::Json => "json",
        }
    }

    /// About how much lz4 shrinks a 4 KiB page of such values (for sizing zram; measured on
    /// pages of 4,000-byte values: letters 1.0, text 1.87, json 2.91).
    pub fn lz4_ratio(self) -> f64 {
        match self {
            Values::Letters => 1.0,
            Values::Text => 1.85,
            Values::Json => 2.9,
        }
    }
}

const WORDS: [&str; 32] = [
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "this", "are", "from", "at", "which", "have", "an", "they", "were", "their",
    "one", "all", "order", "account", "status", "update",
];
const NAMES: [&str; 16] = [
    "alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy", "mallory",
    "niaj", "olivia", "peggy", "rupert", "sybil",
];

/// The value stored under key `k`: `len` bytes derived from `k` as `kind` says, so that every
/// get can be checked.
fn value(k: u64, len: usize, kind: Values) -> Vec<u8> {
    let mut x = k.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut v = Vec::with_capacity(len + 160);
    match kind {
        Values::Letters => v.extend((0..len).map(|_| b'a' + (next() % 26) as u8)),
        Values::Text => {
            while v.len() < len {
                v.extend_from_slice(WORDS[(next() % 32) as usize].as_bytes());
                v.push(b' ');
            }
        }
        Values::Json => {
            v.push(b'[');
            let mut id = k * 1000;
            while v.len() < len {
                let r = next();
                let name = NAMES[(r % 16) as usize];
                id += 1 + (r >> 60);
                let record = format!(
                    "{{\"id\":{id},\"name\":\"{name}\",\"email\":\"{name}.{}@example.com\",\"active\":{},\"score\":{},\"created\":\"2026-{:02}-{:02}T{:02}:{:02}:00Z\"}},",
                    (r >> 8) % 10_000,
                    (r >> 20) % 2 == 0,
                    (r >> 24) % 1000,
                    1 + (r >> 34) % 12,
                    1 + (r >> 38) % 28,
                    (r >> 43) % 24,
                    (r >> 48) % 60,
                );
                v.extend_from_slice(record.as_bytes());
            }
        }
    }
    v.truncate(len);
    v
}

fn key(k: u64) -> String {
    format!("key:{k:012}")
}

/// One client connection.
struct Conn {
    r: BufReader<TcpStream>,
    w: TcpStream,
    server: Server,
    line: String,
}

impl Conn {
    fn open(port: u16, server: Server) -> Result<Conn> {
        let s = TcpStream::connect(("127.0.0.1", port)).context("connecting to the server")?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(Duration::from_secs(60)))?;
        Ok(Conn {
            r: BufReader::new(s.try_clone()?),
            w: s,
            server,
            line: String::new(),
        })
    }

    /// Queues a set (sent by [`flush`](Self::flush)); `out` collects the bytes.
    fn set_cmd(&self, k: &str, v: &[u8], out: &mut Vec<u8>) {
        match self.server {
            Server::Memcached => {
                out.extend_from_slice(format!("set {k} 0 0 {}\r\n", v.len()).as_bytes());
            }
            Server::Redis => {
                out.extend_from_slice(
                    format!("*3\r\n$3\r\nSET\r\n${}\r\n{k}\r\n${}\r\n", k.len(), v.len())
                        .as_bytes(),
                );
            }
        }
        out.extend_from_slice(v);
        out.extend_from_slice(b"\r\n");
    }

    fn read_line(&mut self) -> Result<&str> {
        self.line.clear();
        if self.r.read_line(&mut self.line)? == 0 {
            bail!("the server closed the connection");
        }
        Ok(self.line.trim_end())
    }

    fn expect_stored(&mut self) -> Result<()> {
        let want = match self.server {
            Server::Memcached => "STORED",
            Server::Redis => "+OK",
        };
        let l = self.read_line()?;
        if l != want {
            bail!("set answered {l:?}");
        }
        Ok(())
    }

    /// Sets several keys in one write, then reads the replies.
    fn set_many(&mut self, keys: &[u64], len: usize, kind: Values) -> Result<()> {
        let mut out = Vec::new();
        for &k in keys {
            self.set_cmd(&key(k), &value(k, len, kind), &mut out);
        }
        self.w.write_all(&out)?;
        for _ in keys {
            self.expect_stored()?;
        }
        Ok(())
    }

    /// Gets key `k` into `buf`; false if the server does not have it.
    fn get(&mut self, k: u64, buf: &mut Vec<u8>) -> Result<bool> {
        let name = key(k);
        let req = match self.server {
            Server::Memcached => format!("get {name}\r\n"),
            Server::Redis => format!("*2\r\n$3\r\nGET\r\n${}\r\n{name}\r\n", name.len()),
        };
        self.w.write_all(req.as_bytes())?;
        let header = self.read_line()?.to_string();
        let len = match self.server {
            Server::Memcached => {
                if header == "END" {
                    return Ok(false);
                }
                let len = header
                    .rsplit(' ')
                    .next()
                    .and_then(|n| n.parse::<usize>().ok())
                    .with_context(|| format!("get answered {header:?}"))?;
                len
            }
            Server::Redis => {
                if header == "$-1" {
                    return Ok(false);
                }
                header
                    .strip_prefix('$')
                    .and_then(|n| n.parse::<usize>().ok())
                    .with_context(|| format!("get answered {header:?}"))?
            }
        };
        buf.resize(len + 2, 0);
        self.r.read_exact(buf)?;
        buf.truncate(len);
        if self.server == Server::Memcached {
            let end = self.read_line()?;
            if end != "END" {
                bail!("get did not end with END: {end:?}");
            }
        }
        Ok(true)
    }
}

/// What one run measured.
#[derive(Serialize, Clone, Default)]
struct RunRecord {
    server: String,
    skew: f64,
    config: String,
    rep: usize,
    ops_per_sec: f64,
    p50_us: f64,
    p99_us: f64,
    gets_verified: u64,
    load_seconds: f64,
    peak_dram: Option<u64>,
    /// Under memtide: the server's peak anonymous memory beyond its managed DRAM.
    #[serde(skip_serializing_if = "Option::is_none")]
    unmanaged: Option<u64>,
    /// Linux swap's cgroup limit: the budget plus what memtide's runs kept unmanaged.
    #[serde(skip_serializing_if = "Option::is_none")]
    cgroup_limit: Option<u64>,
    /// Requests' waits for the device while measuring, per request: memtide's tier-1 faults,
    /// or the major faults of Linux's cgroup (none with everything in DRAM).
    device_faults_per_op: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    failed: Option<String>,
    /// `--bgsave`: how long the save took, and the pair's peak DRAM (bytes).
    #[serde(skip_serializing_if = "Option::is_none")]
    save_seconds: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pair_peak: Option<u64>,
}

#[derive(Serialize)]
struct Row {
    server: String,
    skew: f64,
    config: String,
    budget: f64,
    ops_per_sec: f64,
    vs_dram: f64,
    vs_swap: Option<f64>,
    p50_us: f64,
    p99_us: f64,
    p99_vs_dram: f64,
    device_faults_per_op: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    save_seconds: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pair_peak: Option<u64>,
}

fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// A server process, killed when dropped.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = memtide_engine::sys::kill(self.0.id(), libc::SIGKILL);
        let _ = self.0.wait();
    }
}

fn wait_for(port: u16, child: &mut Child) -> Result<()> {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(20) {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(());
        }
        if let Some(st) = child.try_wait()? {
            bail!("the server exited at start ({st})");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    bail!("the server did not listen on port {port} within 20 s")
}

fn percentile(sorted: &[u32], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i] as f64 / 1e3
}

/// How many times the server has waited for the device so far: memtide's tier-1 faults (from
/// its statistics, written every 500 ms) or the major faults of Linux's cgroup.
fn device_faults(place: &Placement, stats_dir: &Path) -> Option<u64> {
    match place {
        Placement::Dram => None,
        Placement::Memtide { .. } => summary::collect(stats_dir)
            .main()
            .map(|(s, _)| s.faults_tier),
        Placement::Cgroup { procs } => {
            let stat = std::fs::read_to_string(procs.parent()?.join("memory.stat")).ok()?;
            stat.lines()
                .find_map(|l| l.strip_prefix("pgmajfault "))
                .and_then(|v| v.trim().parse().ok())
        }
    }
}

/// One run: start the server in `place`, load the dataset, warm up, measure.
fn one_run(
    a: &Common,
    x: &KvArgs,
    server: Server,
    skew: f64,
    place: &Placement,
    label: &str,
) -> Result<RunRecord> {
    let keys = (a.footprint / x.value_bytes as u64).max(1);
    let port = free_port()?;
    let stats = StatsDir::new().context("cannot create a directory for the statistics")?;
    // A BGSAVE's dump goes to disk, beside the tier (never to a tmpfs, whose pages are DRAM).
    let dump_dir = tempfile_dir()?;
    let mut cmd = server.command(port, a.footprint, keys, &dump_dir.0);
    place.apply(&mut cmd, &stats.0);
    // The server never outlives the bench, however that ends.
    die_with_parent(&mut cmd, libc::SIGKILL);
    let mut child = Running(
        cmd.spawn()
            .with_context(|| format!("cannot start {}", server.program()))?,
    );
    wait_for(port, &mut child.0)?;

    // Load: every key once, the connections sharing the key range, 32 sets per write.
    let t0 = Instant::now();
    let loaded = AtomicU64::new(0);
    std::thread::scope(|s| -> Result<()> {
        let handles: Vec<_> = (0..x.clients as u64)
            .map(|c| {
                let loaded = &loaded;
                s.spawn(move || -> Result<()> {
                    let mut conn = Conn::open(port, server)?;
                    let mut k = c * 32;
                    while k < keys {
                        let batch: Vec<u64> = (k..(k + 32).min(keys)).collect();
                        conn.set_many(&batch, x.value_bytes, x.values)?;
                        loaded.fetch_add(batch.len() as u64, Ordering::Relaxed);
                        k += 32 * x.clients as u64;
                    }
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join()
                .map_err(|_| anyhow::anyhow!("a load thread panicked"))??;
        }
        Ok(())
    })
    .with_context(|| format!("{label}: loading the dataset"))?;
    let load_seconds = t0.elapsed().as_secs_f64();
    eprintln!(
        "{label}: loaded {} keys ({} of values) in {load_seconds:.1} s",
        keys,
        memtide_engine::size::format(keys * x.value_bytes as u64)
    );

    // Drive: closed loop per connection; warm-up, then measure.
    let measuring = AtomicBool::new(false);
    let stop = AtomicBool::new(false);
    let zipf = Zipf::new(keys, skew);
    // Popular keys scattered over the key space (and so over the server's memory).
    let stride = scatter_stride(keys);
    let (mut faults0, mut faults1) = (None, None);
    let server_pid = child.0.id();
    let mut save: Option<Result<(f64, u64)>> = None;
    let results: Vec<Result<(Vec<u32>, u64, u64)>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..x.clients as u64)
            .map(|c| {
                let (measuring, stop, zipf) = (&measuring, &stop, &zipf);
                s.spawn(move || -> Result<(Vec<u32>, u64, u64)> {
                    let mut conn = Conn::open(port, server)?;
                    let mut rng = Rng::new(0x5EED + c);
                    let mut lat = Vec::with_capacity(1 << 20);
                    let mut buf = Vec::new();
                    let (mut ops, mut verified) = (0u64, 0u64);
                    while !stop.load(Ordering::Relaxed) {
                        let k = zipf.sample(&mut rng) * stride % keys;
                        let t = Instant::now();
                        if rng.unit() < 0.9 {
                            if !conn.get(k, &mut buf)? {
                                bail!("key {k} is missing: the server lost it");
                            }
                            if buf != value(k, x.value_bytes, x.values) {
                                bail!("key {k} read back a wrong value: data corrupted");
                            }
                            verified += 1;
                        } else {
                            conn.set_many(&[k], x.value_bytes, x.values)?;
                        }
                        if measuring.load(Ordering::Relaxed) {
                            lat.push(t.elapsed().as_nanos().min(u32::MAX as u128) as u32);
                            ops += 1;
                        }
                    }
                    Ok((lat, ops, verified))
                })
            })
            .collect();
        std::thread::sleep(Duration::from_secs_f64(a.warmup));
        faults0 = device_faults(place, &stats.0);
        measuring.store(true, Ordering::Relaxed);
        let m0 = Instant::now();
        if x.bgsave {
            save = Some(bgsave(port, server_pid));
        } else {
            std::thread::sleep(Duration::from_secs_f64(a.seconds));
        }
        measuring.store(false, Ordering::Relaxed);
        let secs = m0.elapsed().as_secs_f64();
        faults1 = device_faults(place, &stats.0);
        stop.store(true, Ordering::Relaxed);
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a client thread panicked")))
                    .map(|(l, o, v)| (l, (o as f64 / secs) as u64, v))
            })
            .collect()
    });
    let mut lat = Vec::new();
    let (mut rate, mut verified) = (0u64, 0u64);
    for r in results {
        let (l, o, v) = r.with_context(|| label.to_string())?;
        lat.extend(l);
        rate += o;
        verified += v;
    }
    let save = save
        .transpose()
        .with_context(|| format!("{label}: BGSAVE"))?;
    lat.sort_unstable();
    let measured_ops = lat.len() as f64;
    let device_faults_per_op = match (faults0, faults1) {
        (Some(f0), Some(f1)) if measured_ops > 0.0 => {
            Some(f1.saturating_sub(f0) as f64 / measured_ops)
        }
        _ => None,
    };
    drop(child);
    let collected = summary::collect(&stats.0);
    let latest = collected.main().map(|(s, _)| s);
    let peak_dram = latest.map(|s| s.peak_dram_bytes);
    let unmanaged = latest.map(|s| beyond_quota(s, s.process_peak_rss_bytes));
    Ok(RunRecord {
        server: server.name().into(),
        skew,
        config: String::new(),
        rep: 0,
        ops_per_sec: rate as f64,
        p50_us: percentile(&lat, 0.50),
        p99_us: percentile(&lat, 0.99),
        gets_verified: verified,
        load_seconds,
        peak_dram,
        unmanaged,
        device_faults_per_op,
        failed: None,
        cgroup_limit: None,
        save_seconds: save.map(|s| s.0),
        pair_peak: save.map(|s| s.1),
    })
}

/// A directory under /var/tmp, removed on drop.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tempfile_dir() -> Result<TempDir> {
    static N: AtomicU64 = AtomicU64::new(0);
    let d = PathBuf::from(format!(
        "/var/tmp/memtide-bench-kv-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&d).with_context(|| format!("cannot create {}", d.display()))?;
    Ok(TempDir(d))
}

/// Asks redis on `port` (process `pid`) for a BGSAVE and waits for it to end: how long it
/// took, and the most DRAM the server and its saving child held at once (the sum of their
/// Pss_Anon, so that a page they share copy-on-write counts once), sampled every 50 ms.
fn bgsave(port: u16, pid: u32) -> Result<(f64, u64)> {
    let c = TcpStream::connect(("127.0.0.1", port))?;
    c.set_read_timeout(Some(Duration::from_secs(600)))?;
    let mut w = c.try_clone()?;
    let mut r = BufReader::new(c);
    let mut line = String::new();
    let t0 = Instant::now();
    w.write_all(b"*1\r\n$6\r\nBGSAVE\r\n")?;
    r.read_line(&mut line)?;
    if !line.starts_with("+Background saving started") {
        bail!("redis answered BGSAVE with {line:?}");
    }
    let mut peak = 0;
    loop {
        peak = peak.max(memtide_launch::procs::tree_pss_anon_bytes(pid));
        w.write_all(b"*2\r\n$4\r\nINFO\r\n$11\r\npersistence\r\n")?;
        line.clear();
        r.read_line(&mut line)?;
        let n: usize = line
            .trim()
            .strip_prefix('$')
            .and_then(|n| n.parse().ok())
            .with_context(|| format!("INFO answered {line:?}"))?;
        let mut info = vec![0; n + 2];
        r.read_exact(&mut info)?;
        let info = String::from_utf8_lossy(&info);
        if info.contains("rdb_bgsave_in_progress:0") {
            if !info.contains("rdb_last_bgsave_status:ok") {
                bail!("the save failed: {info}");
            }
            return Ok((t0.elapsed().as_secs_f64(), peak));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Runs the experiment for `server` under every configuration; prints the table, writes the
/// plot, and returns the JSON section.
pub fn run(
    a: &Common,
    x: &KvArgs,
    server: Server,
    configs: &Configs,
    pools: &mut Pools,
) -> Result<serde_json::Value> {
    let mut same_dram = SameDram::new(a, configs);
    let configs = &configs.0;
    eprintln!(
        "{}: {} of {}-byte values, zipf {:?}, 90% gets / 10% sets, {} connections",
        server.name(),
        memtide_engine::size::format(a.footprint),
        x.value_bytes,
        x.skews,
        x.clients
    );
    let total = a.reps() * x.skews.len() * configs.len();
    let mut records: Vec<RunRecord> = Vec::new();
    let started = Instant::now();
    for rep in 0..a.reps() {
        for &skew in &x.skews {
            for (name, budget, place, pool) in configs {
                let budget = *budget;
                if interrupted() {
                    bail!("interrupted; settings restored");
                }
                let budget_b = crate::lab::budget_bytes(a.footprint, budget * 100.0);
                pools.select(*pool, budget_b, x.values.lz4_ratio())?;
                let label = format!(
                    "{} {} zipf {skew} {name}",
                    crate::report::step_label(records.len(), total, started),
                    server.name()
                );
                let cgroup_limit =
                    same_dram.before(name, budget, place, *pool, pools.cap(*pool, budget_b))?;
                let mut r = match one_run(a, x, server, skew, place, &label) {
                    Ok(r) => r,
                    Err(e) if matches!(place, Placement::Cgroup { .. }) => {
                        eprintln!("{label}: failed: {e:#}");
                        RunRecord {
                            server: server.name().into(),
                            skew,
                            failed: Some(format!("{e:#}")),
                            ..RunRecord::default()
                        }
                    }
                    Err(e) => return Err(e),
                };
                r.config = name.clone();
                r.rep = rep;
                r.cgroup_limit = cgroup_limit;
                if let Some(u) = r.unmanaged {
                    same_dram.saw(budget, u);
                }
                if r.failed.is_none() {
                    eprintln!(
                        "{label}: {:.0} ops/s, p50 {:.0} µs, p99 {:.0} µs, {} gets verified",
                        r.ops_per_sec, r.p50_us, r.p99_us, r.gets_verified
                    );
                }
                records.push(r);
            }
        }
    }
    let med = |skew: f64, c: &str, f: &dyn Fn(&RunRecord) -> f64| {
        median(
            records
                .iter()
                .filter(|r| r.skew == skew && r.config == c && r.failed.is_none())
                .map(f)
                .collect(),
        )
    };
    let cw = config_width(configs.iter().map(|c| c.0.as_str()));
    println!();
    println!(
        "{:<9} {:>5} {:<cw$} {:>10} {:>8} {:>8} {:>9} {:>9} {:>8} {:>10}",
        "server",
        "zipf",
        "config",
        "ops/s",
        "vs DRAM",
        "vs swap",
        "p50 µs",
        "p99 µs",
        "p99 x",
        "reads/req"
    );
    if x.bgsave {
        println!("(measured during a BGSAVE; then: the save's seconds, the pair's peak DRAM)");
    }
    let mut rows = Vec::new();
    for &skew in &x.skews {
        let dram = med(skew, "all-DRAM", &|r| r.ops_per_sec);
        let dram_p99 = med(skew, "all-DRAM", &|r| r.p99_us);
        for (c, budget, _, _) in configs {
            let ops = med(skew, c, &|r| r.ops_per_sec);
            let vs_swap = swap_peer(c, *budget)
                .map(|swap| ops / med(skew, &swap, &|r| r.ops_per_sec))
                .filter(|v| v.is_finite());
            let row = Row {
                server: server.name().into(),
                skew,
                config: c.clone(),
                budget: *budget,
                ops_per_sec: ops,
                vs_dram: ops / dram,
                vs_swap,
                p50_us: med(skew, c, &|r| r.p50_us),
                p99_us: med(skew, c, &|r| r.p99_us),
                p99_vs_dram: med(skew, c, &|r| r.p99_us) / dram_p99,
                device_faults_per_op: Some(med(skew, c, &|r| {
                    r.device_faults_per_op.unwrap_or(f64::NAN)
                }))
                .filter(|v| v.is_finite()),
                save_seconds: Some(med(skew, c, &|r| r.save_seconds.unwrap_or(f64::NAN)))
                    .filter(|v| v.is_finite()),
                pair_peak: Some(med(skew, c, &|r| {
                    r.pair_peak.map_or(f64::NAN, |b| b as f64)
                }))
                .filter(|v| v.is_finite())
                .map(|v| v as u64),
            };
            if ops.is_nan() {
                println!("{:<9} {:>5} {:<cw$} {:>10}", row.server, skew, c, "failed");
            } else {
                println!(
                    "{:<9} {:>5} {:<cw$} {:>10.0} {:>7.3}x {:>8} {:>9.0} {:>9.0} {:>7.2}x {:>10}{}",
                    row.server,
                    skew,
                    c,
                    row.ops_per_sec,
                    row.vs_dram,
                    row.vs_swap.map_or("-".into(), |v| format!("{v:.2}x")),
                    row.p50_us,
                    row.p99_us,
                    row.p99_vs_dram,
                    row.device_faults_per_op
                        .map_or("-".into(), |v| format!("{v:.3}")),
                    match (row.save_seconds, row.pair_peak) {
                        (Some(t), Some(b)) =>
                            format!(" {t:>6.1} s {:>10}", memtide_engine::size::format(b)),
                        _ => String::new(),
                    }
                );
            }
            rows.push(row);
        }
    }
    same_dram.print();
    let mut series = Vec::new();
    for family in ["memtide", "Linux swap", "zswap", "zram"] {
        for &skew in &x.skews {
            let points: Vec<(f64, f64)> = rows
                .iter()
                .filter(|r| r.skew == skew && r.config.starts_with(family))
                .map(|r| (r.budget, r.vs_dram))
                .collect();
            if !points.is_empty() {
                series.push(crate::plot::Series {
                    name: format!("{family}, zipf {skew}"),
                    points,
                });
            }
        }
    }
    let path = PathBuf::from(format!("{}-{}.svg", a.plot.display(), server.name()));
    crate::plot::Chart::ratio_vs_budget(
        format!(
            "memtide bench: {} over {} of values, ops/s vs all-DRAM",
            server.name(),
            memtide_engine::size::format(a.footprint)
        ),
        "DRAM budget, fraction of the dataset",
        "ops/s / all-DRAM",
        series,
    )
    .write(&path)?;
    Ok(serde_json::json!({
        "value_bytes": x.value_bytes,
        "values": x.values.name(),
        "clients": x.clients,
        "bgsave": x.bgsave,
        "skews": x.skews,
        "seconds": a.seconds,
        "warmup": a.warmup,
        "rows": rows,
        "runs": records,
    }))
}
