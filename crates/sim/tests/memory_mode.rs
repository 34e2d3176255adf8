//! The memory-mode model reproduces, qualitatively, the published anomalies of a direct-mapped
//! DRAM cache, and memtide's fully associative placement shows none of them.

use memtide_sim::{simulate, Job, Latency, Outcome, Source, Spec};

const CACHE: u64 = 4096; // pages of DRAM
const LAT: Latency = Latency {
    dram_ns: 100.0,
    tier_ns: 2_000.0,
    soft_ns: 500.0,
    compressed_ns: 15_000.0,
};

fn spec(s: &str) -> Source {
    let parse = |v: &str| -> Option<u64> {
        v.strip_suffix("p")
            .and_then(|n| n.parse::<u64>().ok())
            .map(|n| n * 4096)
    };
    Source::Spec(Spec::parse(s, 4096, parse).unwrap())
}

fn run(src: &Source, policy: &str, cache: u64) -> Outcome {
    let jobs = [Job::new(policy, cache)];
    simulate(src, &jobs, &LAT, 1, &|_, _| {}).unwrap().remove(0)
}

#[test]
fn equal_to_dram_while_the_working_set_fits() {
    // One tenant of 2x the cache, using 40% of it: 0.8x the cache, contiguous.
    let s = spec("tiles:n=1,footprint=8192p,active=40%,accesses=1M,fill=no");
    let mm = run(&s, "memory-mode", CACHE);
    assert!(mm.miss_ratio() < 0.001, "{mm:?}");
}

#[test]
fn large_loss_when_the_heap_is_twice_the_cache() {
    let s = spec("tiles:n=1,footprint=8192p,active=100%,accesses=1M,fill=no");
    let mm = run(&s, "memory-mode", CACHE);
    assert!(mm.miss_ratio() > 0.4, "{mm:?}");
    assert!(mm.slowdown(&LAT) > 5.0);
}

#[test]
fn aliasing_pair_runs_at_about_half_speed_others_do_not() {
    // Footprint = cache: tenant 1 starts exactly one cache size after tenant 0, so their
    // active memory maps to the same sets. With footprint = cache/2 they use different sets.
    let aliasing = spec("tiles:n=2,footprint=4096p,active=40%,accesses=2M,fill=no");
    let apart = spec("tiles:n=2,footprint=2048p,active=80%,accesses=2M,fill=no");
    let a = run(&aliasing, "memory-mode", CACHE);
    let b = run(&apart, "memory-mode", CACHE);
    for t in 0..2 {
        let slow_a = a.tenant_slowdown(t, &LAT);
        let slow_b = b.tenant_slowdown(t, &LAT);
        // At 20x the cost of a DRAM access per miss, a ~50% miss ratio means >= 2x slower.
        assert!(slow_a > 2.0, "aliasing tenant {t}: {slow_a}");
        assert!(slow_b < 1.05, "non-aliasing tenant {t}: {slow_b}");
    }
    // Fully associative placement does not care where tenants live.
    let m = run(&aliasing, "placement", CACHE);
    for t in 0..2 {
        assert!(
            m.tenant_slowdown(t, &LAT) < 1.2,
            "memtide tenant {t}: {}",
            m.tenant_slowdown(t, &LAT)
        );
    }
}

#[test]
fn noisy_neighbour_filling_the_cache_hurts_the_others() {
    // Tenant 0 alone, then beside a tenant that streams over a cache's worth of memory.
    let alone = spec("tiles:n=1,footprint=4096p,active=30%,accesses=1M,seed=3,fill=no");
    let noisy = spec("tiles:n=2,footprint=4096p,active=30%,noisy=1,accesses=2M,seed=3,fill=no");
    let a = run(&alone, "memory-mode", CACHE);
    let n = run(&noisy, "memory-mode", CACHE);
    assert!(a.slowdown(&LAT) < 1.05, "alone: {}", a.slowdown(&LAT));
    assert!(
        n.tenant_slowdown(0, &LAT) > 1.5,
        "beside the noisy tenant: {}",
        n.tenant_slowdown(0, &LAT)
    );
    // In one shared pool a fully associative policy is hurt by the stream too, but less: the
    // quiet tenant's pages are reused sooner than the stream's. (Isolation needs per-tenant
    // budgets, which the engine gives each process.)
    let m = run(&noisy, "lru", CACHE);
    assert!(
        m.tenant_slowdown(0, &LAT) < n.tenant_slowdown(0, &LAT),
        "lru {} vs memory mode {}",
        m.tenant_slowdown(0, &LAT),
        n.tenant_slowdown(0, &LAT)
    );
}
