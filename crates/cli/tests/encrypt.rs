//! `--encrypt-tier` end to end on python: the tier file holds the program's bytes in plaintext
//! without it and none of them with it, the program's data survives the round trip, and a page
//! altered on the device stops the program instead of reaching it.

mod common;

use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::{memtide, require, Scratch};

/// Fills 64 MiB with a marked page each, says its pid, waits for `go`, then checks every page.
const PROGRAM: &str = r#"
import os, sys, time
n = 64 << 20
b = bytearray(n)
for i in range(0, n, 4096):
    b[i:i + 31] = b"MEMTIDE-SECRET-%016d" % i
print(os.getpid(), flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
bad = sum(1 for i in range(0, n, 4096) if b[i:i + 31] != b"MEMTIDE-SECRET-%016d" % i)
print("ok" if bad == 0 else "bad %d" % bad, flush=True)
"#;

const MARKER: &[u8] = b"MEMTIDE-SECRET-";

struct Run {
    child: Child,
    out: BufReader<std::process::ChildStdout>,
    pid: u32,
    go: PathBuf,
}

fn start(dir: &Path, encrypt: bool) -> Run {
    let go = dir.join(format!("go-{encrypt}"));
    let mut cmd = memtide();
    // A small compressed pool (these pages compress about 50:1, so a quarter of the quota
    // would hold them all): most pages pass through it to the tier file, so both levels run,
    // and what lands on the device is what is checked.
    cmd.args([
        "run",
        "--dram",
        "16MiB",
        "--compressed-max",
        "256KiB",
        "--tier",
    ])
    .arg(dir);
    if encrypt {
        cmd.arg("--encrypt-tier");
    }
    let mut child = cmd
        .args(["-q", "--", "python3", "-c", PROGRAM])
        .arg(&go)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    let pid = line
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("no pid: {line:?}"));
    Run {
        child,
        out,
        pid,
        go,
    }
}

/// The program's tier file, through its open descriptor (the file itself is unlinked).
fn tier_file(pid: u32) -> PathBuf {
    let t0 = Instant::now();
    loop {
        for ent in std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .flatten()
        {
            if let Ok(target) = std::fs::read_link(ent.path()) {
                if target.to_string_lossy().contains(".tier") {
                    return ent.path();
                }
            }
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "no tier file open in {pid}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn count(hay: &[u8], needle: &[u8]) -> usize {
    hay.windows(needle.len()).filter(|w| *w == needle).count()
}

fn tier_bytes(pid: u32) -> Vec<u8> {
    let mut v = Vec::new();
    std::fs::File::open(tier_file(pid))
        .unwrap()
        .read_to_end(&mut v)
        .unwrap();
    v
}

/// Lets the program check its data and returns what it said and how it ended.
fn finish(mut r: Run) -> (String, std::process::Output) {
    std::fs::write(&r.go, b"").unwrap();
    let mut said = String::new();
    let _ = r.out.read_to_string(&mut said);
    let o = r.child.wait_with_output().unwrap();
    (said, o)
}

#[test]
fn tier_file_holds_no_plaintext_and_data_round_trips() {
    require("python3");
    let dir = Scratch::new("encrypt");
    // Without encryption the marked pages are there to be found: the search works.
    let plain = start(dir.path(), false);
    let found = count(&tier_bytes(plain.pid), MARKER);
    let (said, o) = finish(plain);
    assert!(
        o.status.success() && said.trim() == "ok",
        "{said} {}",
        common::stderr(&o)
    );
    assert!(
        found > 8000,
        "only {found} plaintext pages in an unencrypted tier file"
    );

    let enc = start(dir.path(), true);
    let bytes = tier_bytes(enc.pid);
    assert!(bytes.len() > 32 << 20, "tier file {} bytes", bytes.len());
    assert_eq!(
        count(&bytes, MARKER),
        0,
        "plaintext in the encrypted tier file"
    );
    let (said, o) = finish(enc);
    assert!(o.status.success(), "{}", common::stderr(&o));
    assert_eq!(said.trim(), "ok", "{}", common::stderr(&o));
}

#[test]
fn an_altered_page_is_refused_not_served() {
    require("python3");
    let dir = Scratch::new("encrypt-tamper");
    let run = start(dir.path(), true);
    {
        let path = tier_file(run.pid);
        let mut f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        // Flip a byte in every page of the first 4 MiB of the tier file.
        for page in 0..1024u64 {
            f.seek(SeekFrom::Start(page * 4096 + 100)).unwrap();
            f.write_all(&[0x5A]).unwrap();
        }
        f.sync_all().unwrap();
    }
    let (said, o) = finish(run);
    let err = common::stderr(&o);
    assert!(!o.status.success(), "the program ran on: {said} {err}");
    assert!(
        !said.contains("ok") && !said.contains("bad"),
        "the program was served: {said}"
    );
    assert!(err.contains("authentication"), "{err}");
}
