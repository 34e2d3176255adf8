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
    #[error("a pool that sizes itself is replayed with the engine's policies only ({list}), not `{0}`", list = SIZABLE_POLICIES.join(", "))]
    NotSizable(String),
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
    /// Whether the pool sizes itself as the engine's does (`--compressed-sizing adaptive`):
    /// from a sixteenth of `dram_pages`, by the policy crate's [`memtide_policy::pool::Sizer`],
    /// up to `pool_pages`.
    pub adaptive: bool,
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
            adaptive: false,
        }
    }

    /// Pages a pool of `pool_pages` of DRAM holds.
    fn holds(&self, pool_pages: u64) -> u64 {
        pool_holds(pool_pages, self.ratio)
    }
}

/// Pages a pool of `pool_pages` of DRAM holds at `ratio` pages per page.
fn pool_holds(pool_pages: u64, ratio: f64) -> u64 {
    (pool_pages as f64 * ratio.max(0.0)) as u64
}

/// The most a pool that sizes itself may take of `dram_pages` when asked for at most
/// `asked_pages`: at most three quarters (as the engine bounds it), and a page less than all.
pub fn adaptive_pool_most(dram_pages: u64, asked_pages: u64) -> u64 {
    asked_pages
        .min(memtide_policy::pool::most_pages(dram_pages))
        .max(1)
        .min(dram_pages.saturating_sub(1))
}

/// The policies whose DRAM a pool that sizes itself can take and give back: the engine's.
pub const SIZABLE_POLICIES: [&str; 3] = ["placement", "placement-exact", "sweep"];

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
        if j.adaptive && j.pool_pages > 0 && !SIZABLE_POLICIES.contains(&j.policy.as_str()) {
            return Err(SimError::NotSizable(j.policy.clone()));
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
    let mut sizer = (leveled && job.adaptive).then(|| PoolSizer::new(job, dram, lat));
    let pool_pages = match &sizer {
        Some(z) => z.pool_pages,
        None if leveled => job.pool_pages,
        None => 0,
    };
    let cap = dram.saturating_sub(pool_pages).max(1);
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
    let pool = leveled.then(|| {
        let pool = PoolModel::new(pages, job.holds(pool_pages));
        Box::new(if sizer.is_some() { pool.sizing() } else { pool })
    });
    let mut warm = Outcome {
        pool,
        ..Outcome::default()
    };
    let mut stream = spec.stream();
    let mut warming = fill_pass.chain(stream.by_ref().take(spec.warmup() as usize));
    loop {
        let mut n = 0;
        for (page, write) in warming.by_ref().take(BATCH) {
            p.access(page, write, &mut warm);
            n += 1;
        }
        if n == 0 {
            break;
        }
        warm.accesses += n;
        if let Some(z) = &mut sizer {
            z.tick(&mut warm, &mut *p);
        }
    }
    if let Some(z) = &mut sizer {
        z.rebase();
    }
    let o = Outcome {
        policy: job.policy.clone(),
        dram_pages: dram,
        pool_pages: if leveled { dram - cap } else { 0 },
        pool_share: if leveled { job.pool_share } else { 0.0 },
        pool: warm.pool.take(),
        // The pool's moves over the whole replay, the warm-up's included.
        pool_grows: warm.pool_grows,
        pool_shrinks: warm.pool_shrinks,
        ..Outcome::default()
    };
    let mut o = run_counted(spec, &mut *p, stream, o, sizer.as_mut());
    if let Some(z) = &sizer {
        // Where the pool ended.
        o.pool_pages = z.pool_pages;
    }
    o.pool = None;
    o
}

/// The engine's pool sizer over a replay: once a period of the replay's estimated time (each
/// access, miss and hint fault priced by the latency model), the policy crate's
/// [`memtide_policy::pool::Sizer`] judges from the replay's counts whether a step more pool
/// would save more than it costs, and the pool and the policy's DRAM move by the step.
struct PoolSizer {
    sizer: memtide_policy::pool::Sizer,
    lat: Latency,
    ratio: f64,
    dram: u64,
    pool_pages: u64,
    min: u64,
    max: u64,
    step: u64,
    /// Running totals over the warm-up and the counted part (the replay's time, its misses
    /// from the pool and the file, hint faults, deactivations), and what the outcome being
    /// replayed into held when they were last brought up to date.
    total: [f64; 5],
    seen: [f64; 5],
}

impl PoolSizer {
    fn new(job: &Job, dram: u64, lat: &Latency) -> PoolSizer {
        use memtide_policy::pool;
        let max = adaptive_pool_most(dram, job.pool_pages);
        let step = pool::step_pages(dram);
        PoolSizer {
            sizer: Default::default(),
            lat: *lat,
            ratio: job.ratio,
            dram,
            pool_pages: pool::default_pages(dram).clamp(1, max.max(1)),
            min: step.min(max),
            max,
            step,
            total: [0.0; 5],
            seen: [0.0; 5],
        }
    }

    /// The counts of `o` the sizer follows: time, pool hits, file misses, hint faults,
    /// deactivations.
    fn counts(&self, o: &Outcome) -> [f64; 5] {
        let l = &self.lat;
        let time = o.accesses as f64 * l.dram_ns
            + o.file_misses() as f64 * l.tier_ns
            + o.compressed_hits as f64 * l.compressed_ns
            + o.soft_faults as f64 * l.soft_ns;
        [
            time,
            o.compressed_hits as f64,
            o.file_misses() as f64,
            o.soft_faults as f64,
            o.deactivations as f64,
        ]
    }

    /// Counting starts in a new outcome.
    fn rebase(&mut self) {
        self.seen = [0.0; 5];
    }

    /// After a batch replayed into `o`: judges a period that has passed, and moves the pool
    /// and the policy's DRAM by its verdict.
    fn tick(&mut self, o: &mut Outcome, p: &mut dyn policies::Policy) {
        use memtide_policy::pool::{Prices, Sample};
        let now = self.counts(o);
        for ((t, n), seen) in self.total.iter_mut().zip(now).zip(self.seen) {
            *t += n - seen;
        }
        self.seen = now;
        let at_ns = self.total[0] as u64;
        if !self.sizer.due(at_ns) {
            return;
        }
        let Some(pool) = o.pool.as_deref_mut() else {
            return;
        };
        let (young, ghost) = pool.young_and_ghost();
        let sample = Sample {
            at_ns,
            pool_faults: self.total[1] as u64,
            pool_ns: self.total[1] * self.lat.compressed_ns,
            file_faults: self.total[2] as u64,
            file_ns: self.total[2] * self.lat.tier_ns,
            young,
            ghost,
            inactive_hits: self.total[3] as u64,
            deactivations: self.total[4] as u64,
        };
        // A step of DRAM holds `step` pages; a step of pool `step` times the ratio.
        pool.set_windows(self.step, (self.step as f64 * self.ratio.max(1.0)) as u64);
        // The latency model's prices are the whole cost of each kind of fault, delivery
        // included.
        let prices = Prices {
            wake_ns: 0.0,
            hint_ns: self.lat.soft_ns,
        };
        // The pages in use: the engine leaves its inactive list out, which the replay does not
        // count apart, so a step's extra hint faults are priced a little lower here.
        let active = self.dram - self.pool_pages;
        let Some(verdict) = self.sizer.judge(sample, self.step, active, prices) else {
            return;
        };
        let step_holds = pool_holds(self.step, self.ratio);
        let used = pool.live() + step_holds / 2 >= pool.cap();
        let moved = self.sizer.apply(
            verdict,
            self.pool_pages,
            self.min,
            self.max,
            self.step,
            used,
            at_ns,
        );
        if let Some(pages) = moved {
            if pages > self.pool_pages {
                o.pool_grows += 1;
            } else {
                o.pool_shrinks += 1;
            }
            self.pool_pages = pages;
            pool.set_cap(pool_holds(pages, self.ratio));
            let resized = p.set_capacity(self.dram - pages);
            assert!(
                resized,
                "only sizable policies replay a pool that sizes itself"
            );
        }
    }
}

/// Replays the counted part of the stream into `o` (after the fill and the warm-up), letting
/// `sizer` move a pool that sizes itself after each batch.
fn run_counted(
    spec: &Source,
    p: &mut dyn policies::Policy,
    mut stream: Box<dyn Iterator<Item = (u64, bool)> + '_>,
    mut o: Outcome,
    mut sizer: Option<&mut PoolSizer>,
) -> Outcome {
    let tenants = spec.tenants();
    if tenants > 1 {
        let bases = spec.tenant_bases();
        o.tenant_accesses = vec![0; tenants];
        o.tenant_misses = vec![0; tenants];
        o.tenant_compressed_hits = vec![0; tenants];
        for (i, (page, write)) in stream.enumerate() {
            let t = bases.partition_point(|&b| b <= page) - 1;
            let (misses, pool) = (o.misses, o.compressed_hits);
            o.accesses += 1;
            p.access(page, write, &mut o);
            o.tenant_accesses[t] += 1;
            o.tenant_misses[t] += o.misses - misses;
            o.tenant_compressed_hits[t] += o.compressed_hits - pool;
            if (i + 1) % BATCH == 0 {
                if let Some(z) = sizer.as_deref_mut() {
                    z.tick(&mut o, p);
                }
            }
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
                if let Some(z) = sizer.as_deref_mut() {
                    z.tick(&mut o, p);
                }
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
        if let Some(z) = sizer.as_deref_mut() {
            z.tick(&mut o, p);
        }
    }
    o.state_bytes = p.state_bytes();
    o
}

/// Accesses generated and replayed at a time.
const BATCH: usize = 4096;
