//! memtide's simulator: replays an access profile under other DRAM sizes and policies, using the
//! same `memtide-policy` crate as the engine, and estimates the slowdown from a latency model.
//! Entry points: [`workload::Spec`], [`simulate`].
#![forbid(unsafe_code)]

pub mod policies;
pub mod workload;

pub use policies::{Latency, Outcome};
pub use workload::{Spec, SpecError};

/// The policies `--policy all` means.
pub const ALL_POLICIES: [&str; 5] = ["memtide", "lru", "clock", "lfu", "opt"];

/// Why a simulation could not run.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SimError {
    #[error("unknown policy `{0}`: choose from memtide, lru, clock, lfu, opt, all")]
    Policy(String),
    #[error("the footprint has {0} pages; the simulator handles at most 2^32")]
    TooLarge(u64),
}

/// One replay to run.
#[derive(Clone, Debug)]
pub struct Job {
    pub policy: String,
    pub dram_pages: u64,
}

/// Runs every job over the workload, `threads` at a time (each job regenerates the same
/// deterministic stream; OPT stores it). `progress` is called as jobs finish.
pub fn simulate(
    spec: &Spec,
    jobs: &[Job],
    lat: &Latency,
    threads: usize,
    progress: &(dyn Fn(usize, usize) + Sync),
) -> Result<Vec<Outcome>, SimError> {
    if spec.pages > u32::MAX as u64 {
        return Err(SimError::TooLarge(spec.pages));
    }
    for j in jobs {
        if !ALL_POLICIES.contains(&j.policy.as_str()) {
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

fn run_job(spec: &Spec, job: &Job, lat: &Latency) -> Outcome {
    let cap = job.dram_pages.min(spec.pages).max(1);
    let fill = if spec.fill { spec.pages } else { 0 };
    let fill_pass = (0..fill).map(|p| (p, true));
    if job.policy == "opt" {
        let trace: Vec<(u32, bool)> = fill_pass
            .chain(spec.generator())
            .map(|(p, w)| (p as u32, w))
            .collect();
        return policies::opt(&trace, spec.pages, cap, fill as usize);
    }
    let mut p = policies::by_name(&job.policy, spec.pages, cap, lat).expect("policy checked");
    let mut warm = Outcome::default();
    for (page, write) in fill_pass {
        p.access(page, write, &mut warm);
    }
    let mut o = Outcome {
        policy: job.policy.clone(),
        dram_pages: cap,
        ..Outcome::default()
    };
    for (page, write) in spec.generator() {
        o.accesses += 1;
        p.access(page, write, &mut o);
    }
    o
}
