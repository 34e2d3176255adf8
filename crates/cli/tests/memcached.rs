//! End to end: memcached (Debian's) under memtide with 256 MiB of DRAM stores 1 GiB of items
//! (4x the budget); a client reads every item back and checks every byte.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::Stdio;
use std::time::Duration;

use common::{free_port, main_stats, memtide, require, value_for, wait_for_port, Scratch, Server};

const VALUE: usize = 60 * 1024;
const ITEMS: u64 = (1 << 30) / VALUE as u64 + 1;

#[test]
fn memcached_items_survive_4x_dram() {
    require("memcached");
    let s = Scratch::new("memcached");
    let port = free_port();
    let stats = s.path().join("stats.json");
    let child = memtide()
        .args(["run", "--dram", "256MiB", "--tier"])
        .arg(s.path())
        .arg("--stats")
        .arg(&stats)
        .args([
            "--stats-interval",
            "200ms",
            "--",
            "memcached",
            "-u",
            "root",
            "-l",
            "127.0.0.1",
            "-p",
        ])
        .arg(port.to_string())
        .args(["-m", "4096", "-c", "64", "-t", "2"])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let server = Server(child);
    wait_for_port(port, Duration::from_secs(10));
    let conn = TcpStream::connect(("127.0.0.1", port)).unwrap();
    conn.set_nodelay(true).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut w = conn.try_clone().unwrap();
    let mut r = BufReader::new(conn);
    let mut line = String::new();
    for k in 0..ITEMS {
        // One write per command: split writes meet Nagle and delayed ACKs.
        let mut m = format!("set key:{k} 0 0 {VALUE}\r\n").into_bytes();
        m.extend_from_slice(&value_for(k, VALUE));
        m.extend_from_slice(b"\r\n");
        w.write_all(&m).unwrap();
        line.clear();
        r.read_line(&mut line).unwrap();
        assert_eq!(line, "STORED\r\n", "set key:{k}");
    }
    let mut bad = 0;
    for k in (0..ITEMS).rev() {
        write!(w, "get key:{k}\r\n").unwrap();
        line.clear();
        r.read_line(&mut line).unwrap();
        assert!(
            line.starts_with(&format!("VALUE key:{k} 0 {VALUE}")),
            "get key:{k}: {line:?} (item evicted or lost)"
        );
        let mut buf = vec![0u8; VALUE + 2];
        r.read_exact(&mut buf).unwrap();
        if buf[..VALUE] != value_for(k, VALUE)[..] {
            bad += 1;
        }
        line.clear();
        r.read_line(&mut line).unwrap();
        assert_eq!(line, "END\r\n");
    }
    assert_eq!(bad, 0, "{bad} of {ITEMS} values came back wrong");
    // Let the stats file catch up, then check that the data really was tiered.
    std::thread::sleep(Duration::from_millis(600));
    drop(server);
    let st = main_stats(&stats);
    assert!(
        st["peak_managed_bytes"].as_u64().unwrap() >= 1 << 30,
        "{st}"
    );
    assert!(st["demotions"].as_u64().unwrap() > 100_000, "{st}");
    assert!(st["faults_tier"].as_u64().unwrap() > 1000, "{st}");
    assert!(
        st["peak_dram_bytes"].as_u64().unwrap() <= (256 << 20) + (2 << 20),
        "{st}"
    );
}
