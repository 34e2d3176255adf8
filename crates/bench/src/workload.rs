//! The built-in workload: random reads and writes over one large anonymous mapping, with a
//! scattered hot set taking a given share of the accesses. Every page carries its index and a
//! write counter mirrored in a shadow table, so the run ends by verifying every page. Prints
//! JSON lines (progress and a final result) for `demo` and `bench`. Entry point: [`main`].

use std::io::Write;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use clap::Args;
use serde::{Deserialize, Serialize};

use memtide_engine::stats::LatencyHistogram;

use crate::opts;

const PAGE: usize = 4096;
const MAGIC: u64 = 0x6D65_6D74_6964_6521;
/// One access in this many is timed, to estimate the share of slow (faulting) accesses.
const SAMPLE: u64 = 64;
/// An access slower than this is counted as slow (a tier-1 or swap fault, not a cache miss).
const SLOW_NS: u64 = 20_000;
/// Accesses between checks of the clock (stop, pacing).
const CHUNK: u64 = 1024;
/// The most load a paced thread that fell behind makes up for.
const MAX_BACKLOG: Duration = Duration::from_millis(50);

#[derive(Args, Debug, Clone)]
pub struct WorkloadArgs {
    /// Bytes of memory the workload touches.
    #[arg(long, value_parser = opts::nonzero_size, default_value = "1GiB")]
    pub footprint: u64,
    /// Fraction of pages in the hot set (scattered over the footprint).
    #[arg(long, value_parser = opts::fraction, default_value = "10%")]
    pub hot: f64,
    /// Fraction of accesses that go to the hot set (the rest are uniform over all pages).
    #[arg(long, value_parser = opts::fraction, default_value = "90%")]
    pub hot_share: f64,
    /// Fraction of accesses that are writes.
    #[arg(long, value_parser = opts::fraction, default_value = "20%")]
    pub writes: f64,
    /// Seconds of random accesses after the fill.
    #[arg(long, value_parser = opts::seconds, default_value = "10")]
    pub seconds: f64,
    /// Seconds of the same random accesses before measuring, so that the result shows the
    /// steady state rather than the warm-up after the fill.
    #[arg(long, value_parser = opts::seconds_or_zero, default_value = "0")]
    pub warmup: f64,
    /// Threads doing accesses.
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Accesses per second per thread (a tenant serving a given load); 0: as fast as it can.
    #[arg(long, default_value_t = 0.0)]
    pub rate: f64,
    /// Sweep the pages in order instead of picking them at random (a tenant streaming over
    /// its memory).
    #[arg(long)]
    pub scan: bool,
    /// What the pages hold besides their index and write counter, named by what lz4 makes of
    /// it: `zero-heavy` (nothing else: all but 16 bytes zero), `random` (random bytes:
    /// incompressible), `2x` (half random, half zero), `3x` (a third random), `text` (English
    /// words). Every byte is checked at the end.
    #[arg(long, value_enum, default_value = "zero-heavy")]
    pub contents: Contents,
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
}

/// What the workload's pages hold besides their index and write counter (words 0 and 1).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Contents {
    /// Nothing: the rest of the page is zero.
    #[default]
    ZeroHeavy,
    /// Random bytes.
    Random,
    /// Half random bytes, half zero: about 2:1 under lz4.
    #[value(name = "2x")]
    Half,
    /// A third random bytes, the rest zero: about 3:1 under lz4.
    #[value(name = "3x")]
    Third,
    /// English words separated by spaces: about 1.6:1 under lz4.
    Text,
}

/// Words 2.. of every page, which the contents fill (the accesses read words 2..502).
const CONTENT_WORDS: usize = PAGE / 8 - 2;

const VOCABULARY: [&str; 64] = [
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there",
    "been", "if", "more", "when", "will", "would", "who", "so", "no", "memory", "page", "cold",
    "hot", "tier", "program", "server", "request", "value", "record", "time", "data", "user",
    "between", "through", "under",
];

impl Contents {
    /// About how much lz4 shrinks a page of these contents (measured in a zram device:
    /// random 1.0, 2x 1.97, 3x 2.92, text 1.65; zero-heavy over 100).
    pub fn lz4_ratio(self) -> f64 {
        match self {
            Contents::ZeroHeavy => 100.0,
            Contents::Random => 1.0,
            Contents::Half => 2.0,
            Contents::Third => 2.9,
            Contents::Text => 1.65,
        }
    }

    /// The name `--contents` takes.
    pub fn name(self) -> &'static str {
        match self {
            Contents::ZeroHeavy => "zero-heavy",
            Contents::Random => "random",
            Contents::Half => "2x",
            Contents::Third => "3x",
            Contents::Text => "text",
        }
    }

    /// Fills `out` with page `p`'s contents (the same for the same page and seed).
    fn page(self, seed: u64, p: usize, out: &mut [u64; CONTENT_WORDS]) {
        let mut rng = Rng((seed ^ (p as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1);
        let random = match self {
            Contents::ZeroHeavy => 0,
            Contents::Random => CONTENT_WORDS,
            Contents::Half => CONTENT_WORDS / 2,
            Contents::Third => CONTENT_WORDS / 3,
            Contents::Text => {
                let mut bytes = [0u8; CONTENT_WORDS * 8];
                let mut at = 0;
                while at < bytes.len() {
                    let w = VOCABULARY[(rng.next() >> 58) as usize].as_bytes();
                    for &b in w.iter().chain(b" ") {
                        if at < bytes.len() {
                            bytes[at] = b;
                            at += 1;
                        }
                    }
                }
                for (k, chunk) in bytes.chunks_exact(8).enumerate() {
                    out[k] = u64::from_le_bytes(chunk.try_into().expect("8 bytes"));
                }
                return;
            }
        };
        for (k, w) in out.iter_mut().enumerate() {
            *w = if k < random { rng.next() } else { 0 };
        }
    }
}

impl WorkloadArgs {
    /// The arguments as a command line for `memtide workload`.
    pub fn to_args(&self) -> Vec<String> {
        vec![
            "workload".into(),
            format!("--footprint={}", self.footprint),
            format!("--hot={}", self.hot),
            format!("--hot-share={}", self.hot_share),
            format!("--writes={}", self.writes),
            format!("--seconds={}", self.seconds),
            format!("--warmup={}", self.warmup),
            format!("--threads={}", self.threads),
            format!("--rate={}", self.rate),
            format!("--contents={}", self.contents.name()),
            format!("--seed={}", self.seed),
        ]
        .into_iter()
        .chain(self.scan.then(|| "--scan".to_string()))
        .collect()
    }
}

/// One line of the workload's output.
#[derive(Serialize, Deserialize, Debug, Clone)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Line {
    Progress {
        phase: String,
        elapsed: f64,
        done: f64,
        accesses: u64,
    },
    Result(WorkloadResult),
}

#[derive(Serialize, Deserialize, Debug, Clone, Default)]
pub struct WorkloadResult {
    pub footprint: u64,
    pub fill_seconds: f64,
    pub run_seconds: f64,
    pub accesses: u64,
    pub throughput: f64,
    pub slow_fraction: f64,
    /// Latency of one access, sampled 1 in 64, in µs (p50 and p99).
    #[serde(default)]
    pub p50_us: f64,
    #[serde(default)]
    pub p99_us: f64,
    /// Latency of the sampled slow accesses (tier-1 or swap faults, as the program waits for
    /// them), in µs (p50 and p99; 0 when none was slow).
    #[serde(default)]
    pub slow_p50_us: f64,
    #[serde(default)]
    pub slow_p99_us: f64,
    pub verified_pages: u64,
    pub mismatches: u64,
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn emit(line: &Line) {
    let mut out = std::io::stdout().lock();
    let _ = serde_json::to_writer(&mut out, line);
    let _ = out.write_all(b"\n");
    let _ = out.flush();
}

/// The workload's memory: an anonymous private mapping made through libc's `mmap`, so that
/// under memtide the preload library manages it as it would a program's (the engine's own
/// `Mapping` goes around libc and would not be). It is kept until the process exits, so that
/// the run summary shows where its pages ended up.
struct Memory {
    base: usize,
    pages: usize,
}

impl Memory {
    fn map(pages: usize) -> std::io::Result<Memory> {
        // SAFETY: a fresh private anonymous mapping, which nothing else refers to.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                pages * PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Memory {
            base: base as usize,
            pages,
        })
    }

    /// Word `k` (of 512) of page `p`.
    fn word(&self, p: usize, k: usize) -> &AtomicU64 {
        assert!(p < self.pages && k < PAGE / 8, "word {k} of page {p}");
        // SAFETY: inside the mapping (checked above) and aligned; the mapping is never
        // unmapped, and is only ever accessed atomically.
        unsafe { &*((self.base + p * PAGE + k * 8) as *const AtomicU64) }
    }
}

pub fn main(a: WorkloadArgs) -> Result<ExitCode> {
    let pages = (a.footprint as usize / PAGE).max(1);
    let len = pages * PAGE;
    if a.threads == 0 {
        bail!("--threads must be at least 1");
    }
    if !(a.rate >= 0.0 && a.rate.is_finite()) {
        bail!("--rate must be 0 (as fast as possible) or a positive number of accesses/s");
    }
    let memory = Memory::map(pages).map_err(|e| anyhow::anyhow!("cannot map {len} bytes: {e}"))?;
    let word = |p: usize, k: usize| memory.word(p, k);
    let shadow: Vec<AtomicU32> = (0..pages).map(|_| AtomicU32::new(0)).collect();

    // Fill: first touch of every page, in order.
    let t0 = Instant::now();
    let mut last = Instant::now();
    let mut contents = [0u64; CONTENT_WORDS];
    for p in 0..pages {
        word(p, 0).store(p as u64 ^ MAGIC, Ordering::Relaxed);
        if a.contents != Contents::ZeroHeavy {
            a.contents.page(a.seed, p, &mut contents);
            for (k, &w) in contents.iter().enumerate() {
                word(p, 2 + k).store(w, Ordering::Relaxed);
            }
        }
        if p % 4096 == 0 && last.elapsed() > Duration::from_millis(250) {
            last = Instant::now();
            emit(&Line::Progress {
                phase: "fill".into(),
                elapsed: t0.elapsed().as_secs_f64(),
                done: p as f64 / pages as f64,
                accesses: 0,
            });
        }
    }
    let fill_seconds = t0.elapsed().as_secs_f64();

    // Random accesses.
    let hot_pages = ((pages as f64 * a.hot) as u64).max(1);
    let mut stride = (2_654_435_761u64 % pages as u64) | 1;
    while gcd(stride, pages as u64) != 1 {
        stride += 2;
    }
    let stop = AtomicBool::new(false);
    let accesses = AtomicU64::new(0);
    let sampled = AtomicU64::new(0);
    let slow = AtomicU64::new(0);
    let mismatches = AtomicU64::new(0);
    let measured = AtomicU64::new(0);
    let measuring = AtomicBool::new(false);
    let latency = LatencyHistogram::default();
    let slow_latency = LatencyHistogram::default();
    let run_time = std::sync::Mutex::new(0.0f64);
    let t1 = Instant::now();
    std::thread::scope(|s| {
        for t in 0..a.threads {
            let (stop, accesses, sampled, slow, mismatches, shadow) =
                (&stop, &accesses, &sampled, &slow, &mismatches, &shadow);
            let (measuring, latency, slow_latency) = (&measuring, &latency, &slow_latency);
            let a = &a;
            s.spawn(move || {
                let mut rng = Rng(a.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (t as u64 + 1) | 1);
                let mut n = 0u64;
                let mut next_page = t * pages / a.threads;
                // Pacing: accesses since `origin`, and whether the measured phase had begun
                // when the origin was last set.
                let (mut origin, mut paced, mut origin_measuring) = (Instant::now(), 0u64, false);
                while !stop.load(Ordering::Relaxed) {
                    if a.rate > 0.0 {
                        // This chunk is due when the previous ones would have taken at the
                        // offered rate. A thread that fell behind runs without sleeping, but
                        // catches up at most MAX_BACKLOG of load (the rest of the load it
                        // missed is lost, as a client's timed-out requests are); the measured
                        // phase starts with no backlog, so no tenant serves more than its rate.
                        let now_measuring = measuring.load(Ordering::Relaxed);
                        let due = Duration::from_secs_f64(paced as f64 / a.rate);
                        let elapsed = origin.elapsed();
                        if now_measuring != origin_measuring || elapsed > due + MAX_BACKLOG {
                            (origin, paced, origin_measuring) = (Instant::now(), 0, now_measuring);
                        } else if let Some(wait) = due.checked_sub(elapsed) {
                            std::thread::sleep(wait);
                        }
                        paced += CHUNK;
                    }
                    for _ in 0..CHUNK {
                        let r = rng.next();
                        let p = if a.scan {
                            next_page = (next_page + 1) % pages;
                            next_page
                        } else if rng.unit() < a.hot_share {
                            ((r % hot_pages).wrapping_mul(stride) % pages as u64) as usize
                        } else {
                            (r % pages as u64) as usize
                        };
                        let write = rng.unit() < a.writes;
                        let timed = n.is_multiple_of(SAMPLE);
                        let ts = timed.then(Instant::now);
                        if write {
                            word(p, 1).fetch_add(1, Ordering::Relaxed);
                            shadow[p].fetch_add(1, Ordering::Relaxed);
                        } else {
                            let k = 2 + (r >> 40) as usize % 500;
                            std::hint::black_box(word(p, k).load(Ordering::Relaxed));
                            if word(p, 0).load(Ordering::Relaxed) != p as u64 ^ MAGIC {
                                mismatches.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        if let Some(ts) = ts {
                            let ns = ts.elapsed().as_nanos() as u64;
                            sampled.fetch_add(1, Ordering::Relaxed);
                            if ns > SLOW_NS {
                                slow.fetch_add(1, Ordering::Relaxed);
                            }
                            if measuring.load(Ordering::Relaxed) {
                                latency.record(ns);
                                if ns > SLOW_NS {
                                    slow_latency.record(ns);
                                }
                            }
                        }
                        n += 1;
                    }
                    accesses.fetch_add(CHUNK, Ordering::Relaxed);
                }
            });
        }
        let mut last = Instant::now();
        while t1.elapsed().as_secs_f64() < a.warmup {
            std::thread::sleep(Duration::from_millis(20));
            if last.elapsed() > Duration::from_millis(250) {
                last = Instant::now();
                emit(&Line::Progress {
                    phase: "warmup".into(),
                    elapsed: t1.elapsed().as_secs_f64(),
                    done: (t1.elapsed().as_secs_f64() / a.warmup).min(1.0),
                    accesses: accesses.load(Ordering::Relaxed),
                });
            }
        }
        // Measure from here.
        let base_accesses = accesses.load(Ordering::Relaxed);
        sampled.store(0, Ordering::Relaxed);
        slow.store(0, Ordering::Relaxed);
        measuring.store(true, Ordering::Relaxed);
        let t2 = Instant::now();
        while t2.elapsed().as_secs_f64() < a.seconds {
            std::thread::sleep(Duration::from_millis(20));
            if last.elapsed() > Duration::from_millis(250) {
                last = Instant::now();
                emit(&Line::Progress {
                    phase: "run".into(),
                    elapsed: t2.elapsed().as_secs_f64(),
                    done: (t2.elapsed().as_secs_f64() / a.seconds).min(1.0),
                    accesses: accesses.load(Ordering::Relaxed) - base_accesses,
                });
            }
        }
        stop.store(true, Ordering::Relaxed);
        measured.store(
            accesses.load(Ordering::Relaxed) - base_accesses,
            Ordering::Relaxed,
        );
        *run_time.lock().unwrap() = t2.elapsed().as_secs_f64();
    });
    let run_seconds = *run_time.lock().unwrap();
    let total = measured.load(Ordering::Relaxed);

    // Verify every page, every byte.
    for (p, writes) in shadow.iter().enumerate() {
        a.contents.page(a.seed, p, &mut contents);
        if word(p, 0).load(Ordering::Relaxed) != p as u64 ^ MAGIC
            || word(p, 1).load(Ordering::Relaxed) != writes.load(Ordering::Relaxed) as u64
            || (0..CONTENT_WORDS).any(|k| word(p, 2 + k).load(Ordering::Relaxed) != contents[k])
        {
            mismatches.fetch_add(1, Ordering::Relaxed);
        }
    }
    let result = WorkloadResult {
        footprint: len as u64,
        fill_seconds,
        run_seconds,
        accesses: total,
        throughput: total as f64 / run_seconds,
        slow_fraction: slow.load(Ordering::Relaxed) as f64
            / sampled.load(Ordering::Relaxed).max(1) as f64,
        p50_us: latency.quantile_us(0.50),
        p99_us: latency.quantile_us(0.99),
        slow_p50_us: slow_latency.quantile_us(0.50),
        slow_p99_us: slow_latency.quantile_us(0.99),
        verified_pages: pages as u64,
        mismatches: mismatches.load(Ordering::Relaxed),
    };
    let bad = result.mismatches > 0;
    emit(&Line::Result(result));
    Ok(if bad {
        ExitCode::from(3)
    } else {
        ExitCode::SUCCESS
    })
}
