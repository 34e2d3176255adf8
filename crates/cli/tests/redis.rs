//! End to end: redis-server (Debian's, persistence off) under memtide with 256 MiB of DRAM
//! holds 1 GiB of values (4x the budget); every value reads back intact; a BGSAVE (which
//! forks) runs while a second client keeps overwriting values, and writes a dump that a fresh,
//! untiered redis loads with the values of the moment of the fork (the overwrites are not in
//! it); the pair's DRAM stays within the budget plus the program's own memory all along;
//! afterwards the tiered server serves the overwritten values and is still tiered (within its
//! budget, reading from the tier).

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{
    free_port, main_stats, memtide, require, tree_pss_anon_bytes, value_for, wait_for_port,
    Scratch, Server,
};

/// What the pair (redis and its BGSAVE child) may hold beyond the 256 MiB budget: redis's own
/// memory outside memtide's (its dictionary, buffers) and the books of the two engines (the
/// parent's page state, and what of it the child changes). Measured: 17 MiB before the
/// fork, 25 MiB at the peak of a save.
const PAIR_SLACK: u64 = 48 << 20;

const VALUE: usize = 64 * 1024;
const KEYS: u64 = (1 << 30) / VALUE as u64;

struct Redis {
    w: TcpStream,
    r: BufReader<TcpStream>,
}

impl Redis {
    fn connect(port: u16) -> Redis {
        let c = TcpStream::connect(("127.0.0.1", port)).unwrap();
        c.set_nodelay(true).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        Redis {
            w: c.try_clone().unwrap(),
            r: BufReader::new(c),
        }
    }

    fn send(&mut self, args: &[&[u8]]) {
        let mut m = format!("*{}\r\n", args.len()).into_bytes();
        for a in args {
            m.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
            m.extend_from_slice(a);
            m.extend_from_slice(b"\r\n");
        }
        self.w.write_all(&m).unwrap();
    }

    fn line(&mut self) -> String {
        let mut l = String::new();
        self.r.read_line(&mut l).unwrap();
        l
    }

    fn bulk(&mut self) -> Option<Vec<u8>> {
        let l = self.line();
        assert!(l.starts_with('$'), "bulk reply expected, got {l:?}");
        let n: i64 = l[1..].trim().parse().unwrap();
        if n < 0 {
            return None;
        }
        let mut b = vec![0u8; n as usize + 2];
        self.r.read_exact(&mut b).unwrap();
        b.truncate(n as usize);
        Some(b)
    }

    fn info(&mut self, section: &str) -> String {
        self.send(&[b"INFO", section.as_bytes()]);
        String::from_utf8(self.bulk().unwrap()).unwrap()
    }

    fn verify_all(&mut self, what: &str) {
        let mut bad = 0;
        for k in (0..KEYS).rev() {
            self.send(&[b"GET", format!("key:{k}").as_bytes()]);
            let v = self
                .bulk()
                .unwrap_or_else(|| panic!("{what}: key:{k} missing"));
            if v != value_for(k, VALUE) {
                bad += 1;
            }
        }
        assert_eq!(bad, 0, "{what}: {bad} of {KEYS} values wrong");
    }
}

fn redis_args(port: u16, dir: &std::path::Path) -> Vec<String> {
    vec![
        "--port".into(),
        port.to_string(),
        "--bind".into(),
        "127.0.0.1".into(),
        "--save".into(),
        "".into(),
        "--appendonly".into(),
        "no".into(),
        "--dir".into(),
        dir.display().to_string(),
        "--dbfilename".into(),
        "dump.rdb".into(),
    ]
}

#[test]
fn redis_values_survive_4x_dram_and_bgsave() {
    require("redis-server");
    let s = Scratch::new("redis");
    let port = free_port();
    let stats = s.path().join("stats.json");
    let child = memtide()
        .args(["run", "--dram", "256MiB", "--tier"])
        .arg(s.path())
        .arg("--stats")
        .arg(&stats)
        .args(["--stats-interval", "200ms", "--", "redis-server"])
        .args(redis_args(port, s.path()))
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let server = Server(child);
    wait_for_port(port, Duration::from_secs(10));
    let mut c = Redis::connect(port);
    for k in 0..KEYS {
        c.send(&[b"SET", format!("key:{k}").as_bytes(), &value_for(k, VALUE)]);
        assert_eq!(c.line(), "+OK\r\n");
    }
    c.verify_all("tiered redis");
    std::thread::sleep(Duration::from_millis(500));
    let before_fork = main_stats(&stats);
    assert!(
        before_fork["demotions"].as_u64().unwrap() > 100_000,
        "{before_fork}"
    );
    assert!(
        before_fork["faults_tier"].as_u64().unwrap() > 1000,
        "{before_fork}"
    );
    assert!(
        before_fork["peak_dram_bytes"].as_u64().unwrap() <= (256 << 20) + (2 << 20),
        "{before_fork}"
    );

    // BGSAVE forks: the child writes the dump from memory as it was at the fork, while a
    // second client overwrites the first keys (after the reply, so after the fork).
    c.send(&[b"BGSAVE"]);
    let l = c.line();
    assert!(l.starts_with("+Background saving started"), "{l:?}");
    let mut w = Redis::connect(port);
    let mut overwritten = 0u64;
    let mut peak_pair = 0u64;
    let start = Instant::now();
    loop {
        for _ in 0..16 {
            let k = overwritten % KEYS;
            w.send(&[
                b"SET",
                format!("key:{k}").as_bytes(),
                &value_for(k + KEYS, VALUE),
            ]);
            assert_eq!(w.line(), "+OK\r\n");
            overwritten += 1;
        }
        peak_pair = peak_pair.max(tree_pss_anon_bytes(server.0.id()));
        let info = c.info("persistence");
        if info.contains("rdb_bgsave_in_progress:0") {
            assert!(info.contains("rdb_last_bgsave_status:ok"), "{info}");
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(300),
            "BGSAVE did not finish"
        );
    }
    assert!(
        peak_pair <= (256 << 20) + PAIR_SLACK,
        "redis and its BGSAVE child held {} MiB at a sample, over the 256 MiB budget and {} MiB \
         of their own",
        peak_pair >> 20,
        PAIR_SLACK >> 20
    );
    let overwritten = overwritten.min(KEYS);
    assert!(overwritten > 0);
    // The parent is still tiered: it serves every value, the overwritten ones new, from the
    // tier, within its budget.
    let after_save = main_stats(&stats);
    let mut bad = 0;
    for k in 0..KEYS {
        c.send(&[b"GET", format!("key:{k}").as_bytes()]);
        let want = value_for(if k < overwritten { k + KEYS } else { k }, VALUE);
        if c.bulk().as_deref() != Some(&want[..]) {
            bad += 1;
        }
    }
    assert_eq!(bad, 0, "tiered redis after BGSAVE: {bad} values wrong");
    std::thread::sleep(Duration::from_millis(500));
    let end = main_stats(&stats);
    assert!(
        end["faults_tier"].as_u64().unwrap() > after_save["faults_tier"].as_u64().unwrap() + 1000,
        "the parent reads from the tier after the fork: {after_save} then {end}"
    );
    assert!(
        end["dram_bytes"].as_u64().unwrap() <= (256 << 20) + (2 << 20),
        "the parent is back within its budget: {end}"
    );
    drop(w);
    drop(c);
    drop(server);

    // A fresh, untiered redis loads the dump.
    let port2 = free_port();
    let plain = Command::new("redis-server")
        .args(redis_args(port2, s.path()))
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let _plain = Server(plain);
    wait_for_port(port2, Duration::from_secs(60));
    let mut c2 = Redis::connect(port2);
    // Wait until loading is done.
    while c2.info("persistence").contains("loading:1") {
        std::thread::sleep(Duration::from_millis(100));
    }
    c2.send(&[b"DBSIZE"]);
    assert_eq!(c2.line(), format!(":{KEYS}\r\n"));
    // The dump holds the values of the moment of the fork: none of the overwrites.
    c2.verify_all("fresh redis from the BGSAVE dump");
}
