//! End to end: a JVM heap several times the DRAM budget. The JVM reserves its heap (and its
//! other spaces) with PROT_NONE and commits it with MAP_FIXED, as QEMU, V8 and .NET do; the
//! reservations are managed, so the heap is tiered. A 1.5 GiB `long[]` under `--dram
//! 512MiB`, with the Parallel and G1 collectors: the program's result must equal the one
//! computed here, at least 90% of the JVM's memory managed, its peak RSS within the budget
//! plus the JVM's own overhead.

mod common;

use std::process::Command;
use std::time::Duration;

use common::{
    assert_peak_rss_within, main_stats, memtide, output_within, require, stderr, Scratch,
};

const MIB: u64 = 1 << 20;
/// The JVM's own resident memory beside its heap (code, metaspace, its C heap, GC
/// structures): about 60 MiB measured; the test allows 192.
const JVM_OVERHEAD: u64 = 192 * MIB;

const PROGRAM: &str = r#"
public class Fill {
    public static void main(String[] a) {
        long n = Long.parseLong(a[0]) * 1024 * 1024 / 8;
        long[] x = new long[(int) n];
        for (int r = 0; r < 2; r++)
            for (int i = 0; i < x.length; i++) x[i] += i * 31L + r;
        long s = 0;
        for (int i = 0; i < x.length; i++) s += x[i] * (i % 7 + 1);
        System.out.println("sum " + s);
    }
}
"#;

fn expected(mib: u64) -> i64 {
    let n = mib * 1024 * 1024 / 8;
    let mut s = 0i64;
    for i in 0..n as i64 {
        let v = (i * 31).wrapping_mul(2).wrapping_add(1);
        s = s.wrapping_add(v.wrapping_mul(i % 7 + 1));
    }
    s
}

fn run(gc: &str) {
    require("java");
    require("javac");
    let s = Scratch::new(&format!("jvm-{gc}"));
    std::fs::write(s.path().join("Fill.java"), PROGRAM).unwrap();
    let c = Command::new("javac")
        .arg("Fill.java")
        .current_dir(s.path())
        .output()
        .unwrap();
    assert!(c.status.success(), "javac: {}", stderr(&c));
    let stats = s.path().join("stats.json");
    let o = output_within(
        memtide()
            .args(["run", "--dram", "512MiB", "--tier"])
            .arg(s.path())
            .arg("--stats")
            .arg(&stats)
            .args(["--", "java", "-Xmx3g", &format!("-XX:+Use{gc}GC"), "-cp"])
            .arg(s.path())
            .args(["Fill", "1536"]),
        Duration::from_secs(300),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).trim(),
        format!("sum {}", expected(1536))
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    let coverage = v["coverage"].as_f64().unwrap();
    assert!(coverage >= 0.9, "{gc}: {:.0}% managed", coverage * 100.0);
    let st = main_stats(&stats);
    assert_peak_rss_within(&st, 512 * MIB, JVM_OVERHEAD, &format!("{gc}: the JVM's"));
    assert!(
        st["tier_write_bytes"].as_u64().unwrap() >= 1024 * MIB,
        "{gc}: the heap went to tier 1: {st}"
    );
}

#[test]
fn parallel_gc_heap_three_times_the_budget() {
    run("Parallel");
}

#[test]
fn g1_heap_three_times_the_budget() {
    run("G1");
}
