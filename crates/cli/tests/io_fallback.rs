//! Without io_uring (here: turned off with MEMTIDE_NO_IO_URING, as a kernel with
//! `kernel.io_uring_disabled` would), tier 1 falls back to pread/pwritev, says so, and keeps
//! the data right; with io_uring the summary names it.

mod common;

use common::{memtide, require, stderr, Scratch};

const PROG: &str = "b = bytearray(range(256)) * (256 * 1024)\nprint(sum(b[::4096]), b[-1])";

fn run(no_uring: bool) -> (String, String) {
    let s = Scratch::new(if no_uring { "psync" } else { "uring" });
    let mut cmd = memtide();
    cmd.args(["run", "--dram", "16MiB", "--tier"])
        .arg(s.path())
        .args(["--", "python3", "-c", PROG]);
    if no_uring {
        cmd.env("MEMTIDE_NO_IO_URING", "1");
    }
    let o = cmd.output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    (
        String::from_utf8_lossy(&o.stdout).trim().to_string(),
        stderr(&o),
    )
}

#[test]
fn pread_fallback_says_so_and_keeps_data() {
    require("python3");
    let want: u64 = (0..64u64 << 20).step_by(4096).map(|i| i % 256).sum();
    let (out, err) = run(true);
    assert_eq!(out, format!("{want} 255"));
    assert!(err.contains("tier 1 uses pread/pwritev"), "{err}");
    let (out, err) = run(false);
    assert_eq!(out, format!("{want} 255"));
    assert!(err.contains("via io_uring"), "{err}");
}
