//! `memtide sim` end to end: bad specs and sizes are one-line errors; a real replay writes JSON
//! in which Belady's OPT misses least and every policy saw the same accesses.

mod common;

use common::{fails_with, memtide, stderr, Scratch};

/// Runs `memtide sim` with `args`, its JSON written to `<name>.json` and its plot to
/// `<name>.svg` in `s`; checks that it succeeded and returns its output and the JSON.
fn sim_json(s: &Scratch, name: &str, args: &[&str]) -> (std::process::Output, serde_json::Value) {
    let json = s.path().join(format!("{name}.json"));
    let o = memtide()
        .arg("sim")
        .args(args)
        .arg("--json")
        .arg(&json)
        .arg("--plot")
        .arg(s.path().join(format!("{name}.svg")))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let v = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    (o, v)
}

/// Runs `memtide sim --corpus` with `args` and its JSON written; returns the printed table and
/// the JSON.
fn corpus_json(s: &Scratch, args: &[&str]) -> (String, serde_json::Value) {
    let json = s.path().join("corpus.json");
    let o = memtide()
        .args(["sim", "--corpus"])
        .args(args)
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let v = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    (String::from_utf8_lossy(&o.stdout).into_owned(), v)
}

#[test]
fn bad_input_is_one_line() {
    fails_with(
        &["sim", "--workload", "uniform", "--compressed", "100%"],
        "below 100%",
    );
    fails_with(
        &["sim", "--workload", "uniform", "--compressed", "a lot"],
        "share of --dram",
    );
    fails_with(
        &[
            "sim",
            "--workload",
            "uniform",
            "--compressed",
            "5%",
            "--ratio",
            "0.5",
        ],
        "from 1 to 64",
    );
    fails_with(
        &["sim", "--workload", "uniform", "--ratio", "3"],
        "describe the pool of --compressed",
    );
    fails_with(
        &["sim", "--workload", "uniform", "--ratio", "2"],
        "describe the pool of --compressed",
    );
    fails_with(
        &["sim", "--corpus", "--compressed", "5%"],
        "--corpus compares policies without one",
    );
    fails_with(
        &["sim", "--workload", "zipfy:skew=1"],
        "unknown workload kind",
    );
    fails_with(&["sim", "--workload", "zipf:skew=-2"], "bad value");
    fails_with(
        &[
            "sim",
            "--workload",
            "uniform:footprint=1GiB",
            "--dram",
            "2GiB",
        ],
        "larger than the footprint",
    );
    fails_with(
        &["sim", "--workload", "uniform", "--dram", "150%"],
        "larger than the footprint",
    );
    fails_with(
        &["sim", "--workload", "uniform", "--policy", "fifo"],
        "unknown policy",
    );
    fails_with(
        &["sim", "--workload", "uniform", "--trace-format", "csv"],
        "--trace-format describes a --trace file",
    );
    fails_with(
        &["sim", "--corpus", "--trace-format", "csv"],
        "--trace-format describes a --trace file",
    );
    fails_with(
        &["sim", "--corpus", "--save-trace", "x.mtt"],
        "--save-trace writes the accesses of a --workload",
    );
    fails_with(
        &["sim", "--workload", "uniform", "--corpus-footprint", "2GiB"],
        "shape --corpus",
    );
    fails_with(
        &["sim", "--workload", "uniform", "--corpus-seeds", "3"],
        "shape --corpus",
    );
    fails_with(
        &["sim", "--corpus", "--corpus-seeds", "0"],
        "--corpus-seeds",
    );
    fails_with(
        &["sim", "--corpus", "--plot", "corpus.svg"],
        "--corpus has no plot",
    );
    fails_with(
        &["sim", "--corpus", "--policy", "lru"],
        "--corpus always compares",
    );
}

#[test]
fn csv_and_oracle_general_traces_replay_alike() {
    let s = Scratch::new("simforeign");
    // 50,000 accesses to 4,000 objects with arbitrary ids, a third of them to 200 hot ones.
    let mut x = 88172645463325252u64;
    let ids: Vec<u64> = (0..50_000)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let k = if x.is_multiple_of(3) {
                x % 200
            } else {
                x % 4000
            };
            k * 1_000_003 + 17
        })
        .collect();
    let mut csv = String::from("timestamp,obj_id,obj_size\n");
    let mut bin = Vec::new();
    for (t, id) in ids.iter().enumerate() {
        csv += &format!("{t},{id},4096\n");
        bin.extend((t as u32).to_le_bytes());
        bin.extend(id.to_le_bytes());
        bin.extend(4096u32.to_le_bytes());
        bin.extend((-1i64).to_le_bytes());
    }
    std::fs::write(s.path().join("t.csv"), csv).unwrap();
    std::fs::write(s.path().join("t.oracleGeneral.bin"), bin).unwrap();
    let run = |file: &str| -> serde_json::Value {
        let trace = s.path().join(file);
        let args = [
            "--dram",
            "10%",
            "--policy",
            "lru,s3fifo,memtide",
            "--trace",
            trace.to_str().unwrap(),
        ];
        sim_json(&s, file, &args).1
    };
    let a = run("t.csv");
    let b = run("t.oracleGeneral.bin");
    let distinct = ids.iter().collect::<std::collections::HashSet<_>>().len() as u64;
    for i in 0..3 {
        let (oa, ob) = (&a["results"][i]["outcome"], &b["results"][i]["outcome"]);
        assert_eq!(oa, ob);
        assert_eq!(oa["first_touches"].as_u64(), Some(distinct));
        let with_first = a["results"][i]["miss_ratio_with_first_touches"]
            .as_f64()
            .unwrap();
        let misses = oa["misses"].as_u64().unwrap();
        assert!(misses > 0);
        assert!((with_first - (misses + distinct) as f64 / 50_000.0).abs() < 1e-12);
    }
    fails_with(
        &[
            "sim",
            "--trace",
            s.path().join("t.csv").to_str().unwrap(),
            "--trace-format",
            "mtt",
        ],
        "not a memtide trace",
    );
}

/// `placement` and `sweep` model the engine, whose quota is at least 64 KiB: below that
/// they are left out, with a note (they once ran at 64 KiB under a smaller label and could
/// beat OPT), and alone they are an error.
#[test]
fn engine_modelled_policies_are_not_simulated_below_the_engines_smallest_quota() {
    let s = Scratch::new("sim-small");
    let (o, v) = sim_json(
        &s,
        "sim",
        &[
            "--workload",
            "zipf:footprint=1MiB,accesses=100k",
            "--dram",
            "4KiB,64KiB",
            "--policy",
            "placement,placement-exact,opt",
        ],
    );
    assert!(
        stderr(&o).contains("placement and sweep are not simulated at 4.00 KiB"),
        "{}",
        stderr(&o)
    );
    let rows: Vec<(String, u64, u64)> = v["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let o = &r["outcome"];
            (
                o["policy"].as_str().unwrap().to_string(),
                o["dram_pages"].as_u64().unwrap(),
                o["misses"].as_u64().unwrap(),
            )
        })
        .collect();
    let at = |p: &str, d: u64| rows.iter().find(|r| r.0 == p && r.1 == d).map(|r| r.2);
    assert_eq!(at("placement", 1), None, "{rows:?}");
    for d in [1, 16] {
        assert!(
            at("placement-exact", d).unwrap() >= at("opt", d).unwrap(),
            "{rows:?}"
        );
    }
    assert!(
        at("placement", 16).unwrap() >= at("opt", 16).unwrap(),
        "{rows:?}"
    );
    fails_with(
        &[
            "sim",
            "--workload",
            "zipf:footprint=1MiB,accesses=100k",
            "--dram",
            "4KiB",
            "--policy",
            "sweep",
        ],
        "give --dram 64KiB or more",
    );
}

#[test]
fn replay_writes_json_with_opt_lowest() {
    let s = Scratch::new("sim");
    let (_, v) = sim_json(
        &s,
        "sim",
        &[
            "--workload",
            "hotcold:footprint=256MiB,hot=10%,share=95%,accesses=2M",
            "--dram",
            "25%,50%",
            "--policy",
            "all",
        ],
    );
    // The sweep's plot: one line per policy.
    let svg = std::fs::read_to_string(s.path().join("sim.svg")).unwrap();
    assert_eq!(svg.matches("<polyline").count(), 10, "{svg}");
    let rows = v["results"].as_array().unwrap();
    assert_eq!(rows.len(), 20);
    for frac in [0.25, 0.5] {
        let at: Vec<_> = rows
            .iter()
            .filter(|r| (r["dram_fraction"].as_f64().unwrap() - frac).abs() < 1e-6)
            .collect();
        let misses = |p: &str| {
            at.iter().find(|r| r["outcome"]["policy"] == p).unwrap()["outcome"]["misses"]
                .as_u64()
                .unwrap()
        };
        for p in [
            "placement",
            "lru",
            "clock",
            "arc",
            "2q",
            "s3fifo",
            "sieve",
            "lfu",
            "gclock",
        ] {
            assert!(misses("opt") <= misses(p), "{p} at {frac}");
            assert!(misses(p) > 0, "{p} at {frac} should miss");
        }
        for r in &at {
            assert_eq!(r["outcome"]["accesses"].as_u64(), Some(2_000_000));
            // Tier-1 read bandwidth: a page per miss at the (slowed) access rate.
            let o = &r["outcome"];
            let misses = o["misses"].as_f64().unwrap();
            let want = misses / 2e6 * 1e7 / r["slowdown"].as_f64().unwrap() * 4096.0 / 1e6;
            let got = r["tier_read_mb_per_sec"].as_f64().unwrap();
            assert!((got - want).abs() <= want * 1e-9 + 1e-9, "{got} vs {want}");
        }
    }
}

#[test]
fn a_compressed_pool_serves_misses_of_pages_that_left_last() {
    let s = Scratch::new("simpool");
    let (o, v) = sim_json(
        &s,
        "pool",
        &[
            "--workload",
            "hotcold:footprint=64MiB,hot=20%,share=90%,accesses=2M,warmup=1M",
            "--dram",
            "50%",
            "--policy",
            "lru,sweep,opt",
            "--compressed",
            "0,25%",
            "--ratio",
            "3",
            "--compressed-latency",
            "10us",
        ],
    );
    let table = String::from_utf8_lossy(&o.stdout);
    assert!(table.contains("from pool"), "{table}");
    let rows = v["results"].as_array().unwrap();
    // lru and sweep with and without the pool; opt once (it keeps none).
    assert_eq!(rows.len(), 5);
    let row = |p: &str, pool: bool| {
        rows.iter()
            .find(|r| r["outcome"]["policy"] == p && (r["outcome"]["pool_pages"] != 0) == pool)
            .unwrap()
    };
    assert!(
        rows.iter()
            .filter(|r| r["outcome"]["policy"] == "opt")
            .count()
            == 1
    );
    for p in ["lru", "sweep"] {
        let (without, with) = (row(p, false), row(p, true));
        let hits = with["outcome"]["compressed_hits"].as_u64().unwrap();
        let misses = with["outcome"]["misses"].as_u64().unwrap();
        // A quarter of the 8192 pages of DRAM, holding 3 each: 6144 of the 10240 pages out.
        assert_eq!(with["outcome"]["pool_pages"], 2048, "{p}");
        assert!(hits > 0 && hits < misses, "{p}: {hits} of {misses}");
        assert_eq!(without["outcome"]["compressed_hits"], 0, "{p}");
        // Fewer pages in use miss more, but a pool hit costs 10 µs where a file miss costs 80.
        assert!(
            misses > without["outcome"]["misses"].as_u64().unwrap(),
            "{p}"
        );
        let file = (misses - hits) as f64;
        let want = 1.0
            + (file * 80e3
                + hits as f64 * 10e3
                + with["outcome"]["soft_faults"].as_f64().unwrap() * 6e3)
                / (2e6 * 100.0);
        let got = with["slowdown"].as_f64().unwrap();
        assert!((got - want).abs() < 1e-9 * want, "{p}: {got} vs {want}");
    }
}

/// `--compressed-sizing adaptive`: the pool moves by the engine's rule over the replay's
/// estimated time. Where pool hits are cheap and pages compress 3:1, it grows from its
/// sixteenth and the replay runs faster than with the sixteenth fixed; where a pool hit costs
/// nearly a file miss and pages hardly compress, it shrinks to its least, a thirty-second.
#[test]
fn a_pool_that_sizes_itself_grows_where_it_saves_and_shrinks_where_it_does_not() {
    let s = Scratch::new("simpool-adaptive");
    let run = |name: &str, extra: &[&str]| -> serde_json::Value {
        let args = [
            &[
                "--workload",
                "hotcold:footprint=64MiB,hot=20%,share=90%,accesses=4M,warmup=2M",
                "--dram",
                "50%",
                "--policy",
                "sweep",
            ][..],
            extra,
        ]
        .concat();
        sim_json(&s, name, &args).1["results"][0].clone()
    };
    let cheap = ["--ratio", "3", "--compressed-latency", "10us"];
    let fixed = run("fixed", &[&["--compressed", "6.25%"][..], &cheap].concat());
    let grown = run(
        "grown",
        &[&["--compressed-sizing", "adaptive"][..], &cheap].concat(),
    );
    // 8192 pages of DRAM: the pool starts at 512 and moves by 256.
    assert_eq!(fixed["outcome"]["pool_pages"], 512);
    let pool = grown["outcome"]["pool_pages"].as_u64().unwrap();
    assert!(
        pool > 512 && pool <= 4096 && grown["outcome"]["pool_grows"].as_u64().unwrap() > 0,
        "{grown}"
    );
    assert_eq!(grown["outcome"]["pool_share"], 0.5, "{grown}");
    let slow = |r: &serde_json::Value| r["slowdown"].as_f64().unwrap();
    assert!(slow(&grown) < slow(&fixed), "{grown} against {fixed}");

    let dear = run(
        "shrunk",
        &[
            "--compressed-sizing",
            "adaptive",
            "--ratio",
            "1.05",
            "--compressed-latency",
            "75us",
        ],
    );
    assert_eq!(dear["outcome"]["pool_pages"], 256, "{dear}");
    assert!(
        dear["outcome"]["pool_shrinks"].as_u64().unwrap() > 0,
        "{dear}"
    );

    // Only the engine's policies can give DRAM to a pool and take it back.
    fails_with(
        &[
            "sim",
            "--workload",
            "zipf:footprint=8MiB,accesses=10K",
            "--policy",
            "lru",
            "--compressed-sizing",
            "adaptive",
        ],
        "replays the engine's policies only",
    );
    fails_with(
        &[
            "sim",
            "--workload",
            "zipf:footprint=8MiB,accesses=10K",
            "--compressed-sizing",
            "often",
        ],
        "write fixed or adaptive",
    );
}

#[test]
fn saved_trace_replays_the_same_and_damage_is_reported() {
    let s = Scratch::new("simtrace");
    let trace = s.path().join("w.mtt");
    let spec = "zipf:footprint=64MiB,skew=0.9,accesses=300K,fill=no";
    let run = |name: &str, args: &[&str]| -> serde_json::Value {
        let args = [&["--dram", "25%", "--policy", "lru,memtide"], args].concat();
        sim_json(&s, name, &args).1
    };
    let trace_arg = trace.to_str().unwrap();
    let a = run("a", &["--workload", spec, "--save-trace", trace_arg]);
    let b = run("b", &["--trace", trace_arg]);
    for i in 0..2 {
        assert_eq!(
            a["results"][i]["outcome"]["misses"],
            b["results"][i]["outcome"]["misses"]
        );
        assert!(a["results"][i]["outcome"]["misses"].as_u64().unwrap() > 0);
    }
    let bytes = std::fs::read(&trace).unwrap();
    std::fs::write(&trace, &bytes[..bytes.len() / 2]).unwrap();
    fails_with(&["sim", "--trace", trace.to_str().unwrap()], "truncated");
    let mut bad = bytes.clone();
    bad[100] ^= 0x10;
    std::fs::write(&trace, &bad).unwrap();
    fails_with(&["sim", "--trace", trace.to_str().unwrap()], "corrupted");
}

/// `--corpus-seeds`: misses are summed over the seeds, and a row's loss is marked beyond the
/// noise exactly when memtide's mean excess over the best policy exceeds twice its standard
/// error across the seeds.
#[test]
fn corpus_over_several_seeds_sums_misses_and_marks_losses_beyond_the_noise() {
    let s = Scratch::new("sim-corpus-seeds");
    let (out, v) = corpus_json(
        &s,
        &[
            "--corpus-footprint",
            "8MiB",
            "--corpus-accesses",
            "100K",
            "--corpus-warmup",
            "100K",
            "--corpus-seeds",
            "3",
            "--dram",
            "25%",
        ],
    );
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 12);
    let mut marked = 0;
    for r in rows {
        assert_eq!(r["seeds"], 3);
        let d: Vec<f64> = r["memtide_excess_by_seed"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert_eq!(d.len(), 3);
        let misses = |p: &str| -> f64 {
            r["outcomes"]
                .as_array()
                .unwrap()
                .iter()
                .find(|o| o["policy"] == p)
                .unwrap()["misses"]
                .as_f64()
                .unwrap()
        };
        let best = r["best_online"].as_str().unwrap();
        // The outcomes are the sums over the seeds: the excesses add up to their difference.
        assert!(
            (d.iter().sum::<f64>() - (misses("placement-exact") - misses(best))).abs() < 1e-6,
            "{r}"
        );
        let mean = d.iter().sum::<f64>() / 3.0;
        let se = (d.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / 2.0 / 3.0).sqrt();
        assert_eq!(r["loss_beyond_noise"], mean > 2.0 * se, "{r}");
        marked += usize::from(mean > 2.0 * se);
    }
    assert!(
        out.contains(&format!("(`!`) on {marked} of 12 rows")),
        "{out}"
    );
    assert_eq!(
        out.lines().filter(|l| l.ends_with('!')).count(),
        marked,
        "{out}"
    );
}

#[test]
fn corpus_compares_memtide_with_the_best_online_policy_on_every_row() {
    let s = Scratch::new("sim-corpus");
    let (out, v) = corpus_json(
        &s,
        &[
            "--corpus-footprint",
            "16MiB",
            "--corpus-accesses",
            "200K",
            "--corpus-warmup",
            "200K",
            "--dram",
            "25%,50%",
        ],
    );
    assert!(out.contains("of 24 rows"), "{out}");
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 24, "12 families at 2 DRAM sizes");
    for r in rows {
        let outcomes = r["outcomes"].as_array().unwrap();
        let misses = |p: &str| -> f64 {
            outcomes.iter().find(|o| o["policy"] == p).unwrap()["misses"]
                .as_f64()
                .unwrap()
        };
        // The best online policy is the one with the fewest misses; the ratio is memtide's
        // misses at the same DRAM (placement-exact) over its misses, and the engine's ratio
        // memtide's with the engine's headroom below the quota.
        let best = r["best_online"].as_str().unwrap();
        for p in ["lru", "clock", "arc", "2q", "s3fifo", "sieve"] {
            assert!(misses(best) <= misses(p), "{best} vs {p}: {r}");
        }
        if misses(best) > 0.0 {
            for (policy, key) in [
                ("placement-exact", "memtide_vs_best"),
                ("placement", "engine_vs_best"),
            ] {
                let want = misses(policy) / misses(best);
                let got = r[key].as_f64().unwrap();
                assert!((got - want).abs() < 1e-9, "{key}: {got} vs {want}");
            }
        }
        assert!(r["memtide_time_vs_best"].as_f64().unwrap() > 0.0);
    }
    // Each online policy against the best of the other five, recounted from the rows.
    let online = ["lru", "clock", "arc", "2q", "s3fifo", "sieve"];
    let peers = v["online_vs_the_others"].as_array().unwrap();
    assert_eq!(peers.len(), online.len());
    for (p, peer) in online.iter().zip(peers) {
        assert_eq!(peer["policy"], *p);
        let (mut at, mut worst) = (0, 0f64);
        for r in rows {
            let misses = |q: &str| -> u64 {
                r["outcomes"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|o| o["policy"] == q)
                    .unwrap()["misses"]
                    .as_u64()
                    .unwrap()
            };
            let others = online
                .iter()
                .filter(|q| *q != p)
                .map(|q| misses(q))
                .min()
                .unwrap();
            at += usize::from(misses(p) <= others);
            if others > 0 {
                worst = worst.max(misses(p) as f64 / others as f64);
            }
        }
        assert_eq!(peer["rows_at_or_below_the_others"], at, "{peer}");
        let got = peer["worst_vs_the_others"].as_f64().unwrap();
        assert!(
            (got - worst).abs() < 1e-9 || worst == 0.0,
            "{peer}: worst {worst}"
        );
    }
    assert!(
        out.contains("each online policy against the best of the other five"),
        "{out}"
    );
}

/// The policies' older names (`memtide-v1`, `memtide`, `memtide-exact`) still replay them:
/// each under its one name, once however many spellings are given, with the misses of a
/// replay by the new names.
#[test]
fn older_policy_names_replay_the_same_policies_once() {
    let s = Scratch::new("simnames");
    let spec = "zipf:footprint=64MiB,skew=0.9,accesses=300K";
    let outcomes = |name: &str, policies: &str| -> Vec<(String, u64)> {
        let (_, v) = sim_json(
            &s,
            name,
            &["--workload", spec, "--dram", "25%", "--policy", policies],
        );
        v["results"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                (
                    r["outcome"]["policy"].as_str().unwrap().to_string(),
                    r["outcome"]["misses"].as_u64().unwrap(),
                )
            })
            .collect()
    };
    let new = outcomes("new", "sweep,placement,placement-exact");
    let old = outcomes(
        "old",
        "memtide-v1,sweep,memtide,placement,memtide-exact,placement-exact",
    );
    assert_eq!(
        new.iter().map(|(p, _)| p.as_str()).collect::<Vec<_>>(),
        ["sweep", "placement", "placement-exact"]
    );
    assert_eq!(old, new);
}
