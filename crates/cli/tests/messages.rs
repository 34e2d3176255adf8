//! memtide's words stay out of the program's streams: a program that reads a child's stderr
//! (as CPython's test_threading does) sees only what the child wrote, while memtide's warning
//! about the child's fork reaches memtide's own stderr, once, and `-q` silences it.

mod common;

use std::time::Duration;

use common::{memtide, natively, output_within, require, stderr, Scratch};

/// A child that manages memory (an 8 MiB bytearray) and forks, run with its stderr in a pipe;
/// the parent prints what the child wrote there.
const SCRIPT: &str = r#"
import subprocess, sys
child = r'''
import os, sys
b = bytearray(8 << 20)
b[::4096] = b"x" * (len(b) // 4096)
pid = os.fork()
if pid == 0:
    os._exit(0 if b[4096] == ord("x") else 1)
_, status = os.waitpid(pid, 0)
sys.stderr.write("child wrote this\n")
print("fork child exited", os.waitstatus_to_exitcode(status))
'''
r = subprocess.run([sys.executable, "-c", child], capture_output=True)
print("stdout", r.stdout)
print("stderr", r.stderr)
"#;

#[test]
fn a_childs_stderr_holds_only_what_the_child_wrote() {
    require("python3");
    let s = Scratch::new("messages");
    let script = s.path().join("child.py");
    std::fs::write(&script, SCRIPT).unwrap();
    let native = natively(std::process::Command::new("python3").arg(&script));
    assert!(native.contains("stderr b'child wrote this\\n'"), "{native}");
    for quiet in [false, true] {
        let mut cmd = memtide();
        cmd.args(["run", "--dram", "4MiB", "--tier"]).arg(s.path());
        if quiet {
            cmd.arg("-q");
        }
        let tiered = output_within(
            cmd.args(["--", "python3"]).arg(&script),
            Duration::from_secs(120),
        );
        assert!(tiered.status.success(), "{}", stderr(&tiered));
        assert_eq!(
            String::from_utf8_lossy(&tiered.stdout),
            native,
            "the child's streams are as without memtide"
        );
        let err = stderr(&tiered);
        let warned = err
            .lines()
            .filter(|l| l.starts_with("memtide: warning: the program forked"))
            .count();
        if quiet {
            assert_eq!(warned, 0, "-q: {err}");
        } else {
            assert_eq!(warned, 1, "memtide says it on its own stderr, once: {err}");
        }
    }
}
