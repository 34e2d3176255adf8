//! memtide's simulator: replays an access profile under other DRAM sizes and policies, using the
//! same `memtide-policy` crate as the engine, and estimates the slowdown from a latency model.
//! Entry points: [`workload::Spec`], [`simulate`].
#![forbid(unsafe_code)]

pub mod corpus;
pub mod import;
pub mod plan;
pub mod policies;
pub mod trace;
pub mod workload;

pub use policies::{Latency, Outcome, PoolModel};
pub use trace::{PoolFigures, Trace, TraceError};
pub use workload::{Spec, SpecError};

/// What to replay: a synthetic workload or a recorded trace.
pub enum Source {
    Spec(Spec),
    /// A trace; each tenant's pages are laid out after the previous tenant's.
    Trace(Trace),
}

impl Source {
    /// Pages in the replayed address space.
    pub fn pages(&self) -> u64 {
        match self {
            Source::Spec(s) => s.pages,
            Source::Trace(t) => t.tenant_pages.iter().sum(),
        }
    }

    /// Number of tenants, and the tenant of a page (tenants' pages are laid out in order).
    pub fn tenants(&self) -> usize {
        match self {
            Source::Spec(s) => s.tenants() as usize,
            Source::Trace(t) => t.tenant_pages.len(),
        }
    }

    fn tenant_bases(&self) -> Vec<u64> {
        match self {
            Source::Spec(s) => {
                let per = s.pages / s.tenants().max(1);
                (0..s.tenants()).map(|t| t * per).collect()
            }
            Source::Trace(t) => t
                .tenant_pages
                .iter()
                .scan(0, |acc, &n| {
                    let b = *acc;
                    *acc += n;
                    Some(b)
                })
                .collect(),
        }
    }

    /// Accesses of the stream replayed before counting starts.
    fn warmup(&self) -> u64 {
        match self {
            Source::Spec(s) => s.warmup,
            Source::Trace(_) => 0,
        }
    }

    fn fill(&self) -> u64 {
        match self {
            Source::Spec(s) if s.fill => s.pages,
            _ => 0,
        }
    }

    /// The accesses, as `(page, write)`.
    pub fn stream(&self) -> Box<dyn Iterator<Item = (u64, bool)> + '_> {
        match self {
            Source::Spec(s) => Box::new(s.generator()),
            Source::Trace(t) => {
                let base = self.tenant_bases();
                Box::new(
                    t.records()
                        .map(move |r| (base[r.tenant as usize] + r.page, r.write)),
                )
            }
        }
    }
}

/// The policies `--policy all` means.
pub const ALL_POLICIES: [&str; 10] = [
    "placement",
    "lru",
    "clock",
    "arc",
    "2q",
    "s3fifo",
    "sieve",
    "lfu",
    "gclock",
    "opt",
];

/// Every policy the simulator knows (`memory-mode` is the direct-mapped DRAM cache model,
/// `placement-exact` memtide's placement with no headroom below the quota, `sweep` the CLOCK
/// sweep the engine runs by default). `placement` and `sweep` are the engine's names too.
pub const KNOWN_POLICIES: [&str; 13] = [
    "placement",
    "placement-exact",
    "lru",
    "clock",
    "arc",
    "2q",
    "s3fifo",
    "sieve",
    "lfu",
    "gclock",
    "opt",
    "memory-mode",
    "sweep",
];

/// The policy a name stands for: the name itself, or the policy an older name meant
/// (`memtide` for `placement`, `memtide-exact`, `memtide-v1` for `sweep`).
pub fn policy_name(name: &str) -> &str {
    match name {
        "memtide" => "placement",
        "memtide-exact" => "placement-exact",
        "memtide-v1" => "sweep",
        other => other,
    }
}

/// Why a simulation could not run.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SimError {
    #[error("unknown policy `{0}`: choose from {list}, all", list = KNOWN_POLICIES.join(", "))]
    Policy(String),
    #[error("the footprint has {0} pages; the simulator handles at most 2^32")]
    TooLarge(u64),
}

/// One replay to run.
#[derive(Clone, Debug)]
pub struct Job {
    pub policy: String,
    /// All the DRAM: the pages in use and, if `pool_pages` is not 0, the compressed pool.
    pub dram_pages: u64,
    /// Of `dram_pages`, the DRAM the compressed pool takes (0: no compressed level), and the
    /// share of `dram_pages` that was asked for (for the report).
    pub pool_pages: u64,
    pub pool_share: f64,
    /// Pages the pool holds per page of its DRAM (the compression ratio, with the pool's
    /// packing losses).
    pub ratio: f64,
}

impl Job {
    /// A replay of `policy` with `dram_pages` of DRAM and no compressed level.
    pub fn new(policy: impl Into<String>, dram_pages: u64) -> Job {
        Job {
            policy: policy.into(),
            dram_pages,
            pool_pages: 0,
            pool_share: 0.0,
            ratio: 1.0,
        }
    }

    /// Pages the pool holds.
    fn pool_capacity(&self) -> u64 {
        (self.pool_pages as f64 * self.ratio.max(0.0)) as u64
    }
}

/// Runs every job over the workload, `threads` at a time (each job regenerates the same
/// deterministic stream; OPT stores it). `progress` is called as jobs finish.
pub fn simulate(
    spec: &Source,
    jobs: &[Job],
    lat: &Latency,
    threads: usize,
    progress: &(dyn Fn(usize, usize) + Sync),
) -> Result<Vec<Outcome>, SimError> {
    if spec.pages() > u32::MAX as u64 {
        return Err(SimError::TooLarge(spec.pages()));
    }
    for j in jobs {
        if !KNOWN_POLICIES.contains(&j.policy.as_str()) {
            return Err(SimError::Policy(j.policy.clone()));
        }
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let done = std::sync::atomic::AtomicUsize::new(0);
    let results = std::sync::Mutex::new(vec![None; jobs.len()]);
    std::thread::scope(|s| {
        for _ in 0..threads.max(1).min(jobs.len().max(1)) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(job) = jobs.get(i) else { break };
                let out = run_job(spec, job, lat);
                results.lock().unwrap()[i] = Some(out);
                let d = done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
                progress(d, jobs.len());
            });
        }
    });
    Ok(results
        .into_inner()
        .unwrap()
        .into_iter()
        .map(|o| o.expect("every job ran"))
        .collect())
}

fn run_job(spec: &Source, job: &Job, lat: &Latency) -> Outcome {
    let pages = spec.pages();
    let dram = job.dram_pages.min(pages).max(1);
    // The pool's DRAM is taken from the pages in use (opt and memory-mode keep no pool).
    let leveled = job.pool_pages > 0 && job.policy != "opt" && job.policy != "memory-mode";
    let cap = if leveled {
        dram.saturating_sub(job.pool_pages).max(1)
    } else {
        dram
    };
    let fill = spec.fill();
    let fill_pass = (0..fill).map(|p| (p, true));
    if job.policy == "opt" {
        let trace: Vec<(u32, bool)> = fill_pass
            .chain(spec.stream())
            .map(|(p, w)| (p as u32, w))
            .collect();
        return policies::opt(&trace, pages, cap, (fill + spec.warmup()) as usize);
    }
    let mut p = policies::by_name(&job.policy, pages, cap, lat).expect("policy checked");
    let mut warm = Outcome {
        pool: leveled.then(|| Box::new(PoolModel::new(pages, job.pool_capacity()))),
        ..Outcome::default()
    };
    let mut stream = spec.stream();
    for (page, write) in fill_pass.chain(stream.by_ref().take(spec.warmup() as usize)) {
        p.access(page, write, &mut warm);
    }
    let o = Outcome {
        policy: job.policy.clone(),
        dram_pages: dram,
        pool_pages: if leveled { dram - cap } else { 0 },
        pool_share: if leveled { job.pool_share } else { 0.0 },
        pool: warm.pool.take(),
        ..Outcome::default()
    };
    let mut o = run_counted(spec, &mut *p, stream, o);
    o.pool = None;
    o
}

/// Replays the counted part of the stream into `o` (after the fill and the warm-up).
fn run_counted(
    spec: &Source,
    p: &mut dyn policies::Policy,
    mut stream: Box<dyn Iterator<Item = (u64, bool)> + '_>,
    mut o: Outcome,
) -> Outcome {
    let tenants = spec.tenants();
    if tenants > 1 {
        let bases = spec.tenant_bases();
        o.tenant_accesses = vec![0; tenants];
        o.tenant_misses = vec![0; tenants];
        o.tenant_compressed_hits = vec![0; tenants];
        for (page, write) in stream {
            let t = bases.partition_point(|&b| b <= page) - 1;
            let (misses, pool) = (o.misses, o.compressed_hits);
            o.accesses += 1;
            p.access(page, write, &mut o);
            o.tenant_accesses[t] += 1;
            o.tenant_misses[t] += o.misses - misses;
            o.tenant_compressed_hits[t] += o.compressed_hits - pool;
        }
        o.state_bytes = p.state_bytes();
        return o;
    }
    if let Source::Trace(t) = spec {
        if let Some(accesses) = t.decoded() {
            // Decoded once already: replay it in place.
            for batch in accesses.chunks(BATCH) {
                o.accesses += batch.len() as u64;
                p.access_batch(batch, &mut o);
            }
            o.state_bytes = p.state_bytes();
            return o;
        }
    }
    let mut batch = Vec::with_capacity(BATCH);
    loop {
        batch.clear();
        batch.extend(stream.by_ref().take(BATCH).map(|(p, w)| p << 1 | w as u64));
        if batch.is_empty() {
            break;
        }
        o.accesses += batch.len() as u64;
        p.access_batch(&batch, &mut o);
    }
    o.state_bytes = p.state_bytes();
    o
}

/// Accesses generated and replayed at a time.
const BATCH: usize = 4096;
