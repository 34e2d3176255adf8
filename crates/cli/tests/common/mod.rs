//! Helpers shared by the end-to-end tests: the memtide binary, scratch directories, free
//! loopback ports, the `--stats` JSON, and the test guest.
#![allow(dead_code)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

pub fn memtide() -> Command {
    Command::new(env!("CARGO_BIN_EXE_memtide"))
}

/// A scratch directory under /var/tmp (a disk filesystem with O_DIRECT), removed on drop.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(name: &str) -> Scratch {
        let p =
            PathBuf::from("/var/tmp").join(format!("memtide-test-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Scratch(p)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub fn wait_for_port(port: u16, timeout: Duration) {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("nothing listens on port {port} after {timeout:?}");
}

/// Whether a program is installed (the real-program tests need it: CI installs it).
pub fn require(program: &str) {
    let ok = Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {program}"))
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        ok,
        "{program} is not installed: run `bash .ci/run` (it installs it) or apt-get install it"
    );
}

/// The stats of the process that managed the most memory, from a `--stats` file.
pub fn main_stats(path: &Path) -> serde_json::Value {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let pid = v["main_pid"].as_u64().expect("stats name a main process");
    v["processes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pid"].as_u64() == Some(pid))
        .cloned()
        .unwrap()
}

/// Asserts that a process's peak RSS, from its `--stats` entry, is within `budget` bytes of
/// DRAM plus `overhead` bytes of the program's own.
pub fn assert_peak_rss_within(st: &serde_json::Value, budget: u64, overhead: u64, what: &str) {
    const MIB: u64 = 1 << 20;
    let peak = st["process_peak_rss_bytes"].as_u64().unwrap();
    assert!(
        peak <= budget + overhead,
        "{what} peak RSS {} MiB, budget {} MiB + {} MiB overhead",
        peak / MIB,
        budget / MIB,
        overhead / MIB
    );
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Runs `cmd` without memtide, as the reference a tiered run is compared with: it must
/// succeed. Its standard output.
pub fn natively(cmd: &mut Command) -> String {
    let o = cmd.output().expect("run the program natively");
    assert!(o.status.success(), "{}", stderr(&o));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Deterministic value bytes for a key.
pub fn value_for(key: u64, len: usize) -> Vec<u8> {
    let mut x = key.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// A server started for a test, stopped (SIGTERM, then reaped) when dropped.
pub struct Server(pub Child);

impl Drop for Server {
    fn drop(&mut self) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        let _ = self.0.wait();
    }
}

/// Runs memtide with `args` and checks that it fails with one short line containing `needle`,
/// without a panic or backtrace.
pub fn fails_with(args: &[&str], needle: &str) {
    let o = memtide().args(args).output().unwrap();
    let err = stderr(&o);
    assert!(!o.status.success(), "{args:?} should fail");
    assert!(
        err.contains(needle),
        "{args:?}: expected {needle:?} in {err:?}"
    );
    assert!(
        !err.contains("panicked") && !err.contains("RUST_BACKTRACE"),
        "{err}"
    );
    assert!(
        err.trim().lines().count() <= 3,
        "one short message, got {err:?}"
    );
}

/// Runs `cmd` to completion like `Command::output`, but kills it and its whole process group
/// (the program memtide started included) if it runs longer than `limit`, and then fails the
/// test saying so: a hang costs minutes, not the whole CI budget.
pub fn output_within(cmd: &mut Command, limit: Duration) -> Output {
    run_within(cmd, limit, None)
}

/// [`output_within`], with the program's standard input piped: once `done` holds (asked
/// every 100 ms) a line is sent on it (a guest waiting on its console for the test to say it
/// has seen what it waited for).
pub fn output_within_telling(
    cmd: &mut Command,
    limit: Duration,
    done: impl FnMut() -> bool + Send + 'static,
) -> Output {
    run_within(cmd, limit, Some(Box::new(done)))
}

type Tell = Box<dyn FnMut() -> bool + Send>;

fn run_within(cmd: &mut Command, limit: Duration, mut tell: Option<Tell>) -> Output {
    use std::io::Write;
    use std::os::unix::process::CommandExt;
    use std::process::Stdio;
    if tell.is_some() {
        cmd.stdin(Stdio::piped());
    }
    let mut child = cmd
        .process_group(0)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let mut stdin = child.stdin.take();
    let (done, wait) = std::sync::mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        let t0 = Instant::now();
        loop {
            match wait.recv_timeout(Duration::from_millis(100)) {
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                _ => return false,
            }
            if t0.elapsed() > limit {
                let _ = Command::new("kill")
                    .args(["-KILL", "--", &format!("-{pid}")])
                    .status();
                return true;
            }
            if let (Some(f), Some(input)) = (&mut tell, &mut stdin) {
                if f() {
                    let _ = input.write_all(b"done\n");
                    let _ = input.flush();
                    tell = None;
                }
            }
        }
    });
    let out = child.wait_with_output().unwrap();
    let _ = done.send(());
    let timed_out = watchdog.join().unwrap();
    assert!(
        !timed_out,
        "{cmd:?} did not finish within {limit:?} (killed); its stderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The test guest (vmlinuz, initramfs), built by `vm/build-guest.sh` into target/guest if it is
/// not there yet.
pub fn guest() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = root.join("target/guest");
    let o = Command::new("bash")
        .arg(root.join("vm/build-guest.sh"))
        .arg(&out)
        .output()
        .expect("run vm/build-guest.sh");
    assert!(
        o.status.success(),
        "building the guest failed: {}",
        stderr(&o)
    );
    out
}

#[allow(unused_imports)]
pub use memtide_launch::procs::tree_pss_anon_bytes;
