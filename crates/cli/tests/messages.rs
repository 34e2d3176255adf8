//! memtide's words stay out of the program's streams: a program that reads a child's stderr
//! (as CPython's test_threading does) sees only what the child wrote, while memtide's warning
//! about the child's fork reaches memtide's own stderr, once, and `-q` silences it. (The
//! warning comes from the fork fallback, taken where the kernel does not report forks to
//! memtide: here, run without CAP_SYS_PTRACE, as in a container that does not grant it. With
//! it, both processes stay tiered and there is nothing to warn of.)

mod common;

use std::time::Duration;

use common::{memtide, natively, output_within, require, stderr, Scratch};

/// `memtide` started without CAP_SYS_PTRACE (which userfaultfd's fork events need).
fn memtide_without_ptrace() -> std::process::Command {
    let mut c = std::process::Command::new("setpriv");
    c.args(["--bounding-set=-sys_ptrace", "--inh-caps=-sys_ptrace", "--"])
        .arg(memtide().get_program());
    c
}

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
        let mut cmd = memtide_without_ptrace();
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
            .filter(|l| {
                l.starts_with("memtide: warning: the program forked")
                    && l.contains("CAP_SYS_PTRACE")
            })
            .count();
        if quiet {
            assert_eq!(warned, 0, "-q: {err}");
        } else {
            assert_eq!(warned, 1, "memtide says it on its own stderr, once: {err}");
        }
    }
}

/// With `--log FILE`, memtide's own words (the fork warning from inside the program, the
/// summary) go to the file, appended, and its stderr carries only what the program wrote.
#[test]
fn with_log_memtides_words_go_to_the_file_and_stderr_is_the_programs() {
    require("python3");
    let s = Scratch::new("messages-log");
    let script = s.path().join("fork.py");
    std::fs::write(
        &script,
        r#"
import os, sys
b = bytearray(8 << 20)
b[::4096] = b"x" * (len(b) // 4096)
pid = os.fork()
if pid == 0:
    os._exit(0 if b[4096] == ord("x") else 1)
os.waitpid(pid, 0)
sys.stderr.write("the program's own words\n")
"#,
    )
    .unwrap();
    let log = s.path().join("memtide.log");
    std::fs::write(&log, "an earlier line\n").unwrap();
    let out = output_within(
        memtide_without_ptrace()
            .args(["run", "--dram", "4MiB", "--tier"])
            .arg(s.path())
            .arg("--log")
            .arg(&log)
            .args(["--", "python3"])
            .arg(&script),
        Duration::from_secs(120),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stderr(&out), "the program's own words\n");
    let logged = std::fs::read_to_string(&log).unwrap();
    assert!(
        logged.starts_with("an earlier line\n"),
        "appended: {logged}"
    );
    assert_eq!(
        logged
            .lines()
            .filter(|l| l.starts_with("memtide: warning: the program forked"))
            .count(),
        1,
        "{logged}"
    );
    assert!(
        logged
            .lines()
            .any(|l| l.starts_with("memtide: python3 exited")),
        "the summary: {logged}"
    );
    // A log that cannot be opened is one line and nothing runs.
    let ran = s.path().join("ran");
    let out = output_within(
        memtide()
            .args([
                "run",
                "--dram",
                "4MiB",
                "--log",
                "/nonexistent/dir/x.log",
                "--",
            ])
            .args(["python3", "-c"])
            .arg(format!("open({:?}, 'w')", ran.display().to_string())),
        Duration::from_secs(60),
    );
    assert!(!ran.exists(), "the program must not start");
    assert!(!out.status.success());
    let err = stderr(&out);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("cannot open the log /nonexistent/dir/x.log"),
        "{err}"
    );
}
