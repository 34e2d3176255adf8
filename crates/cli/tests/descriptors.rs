//! memtide's file descriptors stay out of the program's way: a program started with its
//! standard descriptors closed gets them back from its own opens (never finds memtide's
//! userfaultfd or tier file there), and a program that closes every descriptor above 2 (as
//! daemons, supervisors and CPython's subprocess do) keeps running with memtide's intact:
//! it allocates, faults from tier 1 and forks afterwards with the same results as natively.

mod common;

use std::time::Duration;

use common::{main_stats, memtide, natively, output_within, require, stderr, Scratch};

/// Run with fds 0 and 1 closed: what the first two opens get, and whether 0 and 1 were open
/// before them. Then 64 MiB of managed memory written and read back (tier faults at 16 MiB).
const STANDARD_CLOSED: &str = r#"
import os, sys
def is_open(fd):
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False
before = [is_open(0), is_open(1)]
a = os.open("/dev/null", os.O_RDONLY)
b = os.open("/dev/null", os.O_RDONLY)
buf = bytearray(64 << 20)
for i in range(0, len(buf), 4096):
    buf[i] = i // 4096 % 251
total = sum(buf[i] for i in range(0, len(buf), 4096))
os.write(2, f"open before {before} first opens {a} {b} sum {total}\n".encode())
"#;

/// Closes every descriptor above 2 in three ways (os.closerange, which calls close_range;
/// os.close one by one; libc's closefrom), then uses managed memory through tier 1 and forks
/// a child that checks what it inherited.
const CLOSE_ALL: &str = r#"
import ctypes, os, sys
way = sys.argv[1]
buf = bytearray(48 << 20)
for i in range(0, len(buf), 4096):
    buf[i] = i // 4096 % 251
if way == "closerange":
    os.closerange(3, 1 << 20)
elif way == "close":
    for fd in range(3, 4096):
        try:
            os.close(fd)
        except OSError:
            pass
else:
    ctypes.CDLL(None).closefrom(3)
more = bytearray(48 << 20)
for i in range(0, len(more), 4096):
    more[i] = (i // 4096 + 7) % 251
total = sum(buf[i] for i in range(0, len(buf), 4096)) + sum(more[i] for i in range(0, len(more), 4096))
pid = os.fork()
if pid == 0:
    ok = sum(buf[i] for i in range(0, len(buf), 4096)) + sum(more[i] for i in range(0, len(more), 4096)) == total
    os._exit(0 if ok else 1)
_, status = os.waitpid(pid, 0)
print(way, "sum", total, "child", os.waitstatus_to_exitcode(status))
"#;

#[test]
fn standard_descriptors_closed_at_start_stay_the_programs() {
    require("python3");
    let s = Scratch::new("descriptors-std");
    let script = s.path().join("std.py");
    std::fs::write(&script, STANDARD_CLOSED).unwrap();
    let run = |tiered: bool| -> String {
        let mut cmd = if tiered {
            memtide()
        } else {
            std::process::Command::new("sh")
        };
        if tiered {
            cmd.args(["run", "-q", "--dram", "16MiB", "--tier"])
                .arg(s.path())
                .args(["--", "sh"]);
        }
        cmd.arg("-c")
            .arg(format!("exec 0<&- 1>&-; exec python3 {}", script.display()));
        let out = output_within(&mut cmd, Duration::from_secs(120));
        assert!(out.status.success(), "{}", stderr(&out));
        let err = stderr(&out);
        err.lines()
            .find(|l| l.starts_with("open before"))
            .unwrap_or_else(|| panic!("no result line in {err}"))
            .to_string()
    };
    let native = run(false);
    assert!(
        native.starts_with("open before [False, False] first opens 0 1"),
        "{native}"
    );
    assert_eq!(run(true), native);
}

#[test]
fn a_program_closing_every_descriptor_keeps_memtide_working() {
    require("python3");
    let s = Scratch::new("descriptors-close");
    let script = s.path().join("close.py");
    std::fs::write(&script, CLOSE_ALL).unwrap();
    for way in ["closerange", "close", "closefrom"] {
        let native = natively(std::process::Command::new("python3").arg(&script).arg(way));
        assert!(native.ends_with(" child 0\n"), "{native}");
        let stats = s.path().join(format!("{way}.json"));
        let out = output_within(
            memtide()
                .args(["run", "--dram", "16MiB", "--tier"])
                .arg(s.path())
                .arg("--stats")
                .arg(&stats)
                .args(["--", "python3"])
                .arg(&script)
                .arg(way),
            Duration::from_secs(180),
        );
        assert!(out.status.success(), "{way}: {}", stderr(&out));
        assert_eq!(String::from_utf8_lossy(&out.stdout), native, "{way}");
        let tier_faults = main_stats(&stats)["faults_tier"].as_u64().unwrap();
        assert!(
            tier_faults > 0,
            "{way}: the run read from tier 1 after closing ({tier_faults} tier faults)"
        );
    }
}

/// A forked child runs its own engine: closing every descriptor it inherited closes the
/// program's as natively and leaves memtide's working, so the child still reads its memory
/// from tier 1 afterwards. Its listing of descriptors below memtide's is the native one.
#[test]
fn a_forked_child_closing_everything_keeps_its_engine() {
    require("python3");
    let s = Scratch::new("descriptors-fork");
    let script = s.path().join("fork.py");
    std::fs::write(
        &script,
        r#"
import os
b = bytearray(32 << 20)
for i in range(0, len(b), 4096):
    b[i] = i % 251
pid = os.fork()
if pid == 0:
    os.closerange(3, 1 << 20)
    left = sorted(int(x) for x in os.listdir("/proc/self/fd") if int(x) < 900)
    print("child keeps", left, "sum", sum(b[i] for i in range(0, len(b), 4096)), flush=True)
    os._exit(0)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status))
"#,
    )
    .unwrap();
    let native = natively(std::process::Command::new("python3").arg(&script));
    assert!(native.starts_with("child keeps [0, 1, 2"), "{native}");
    let out = output_within(
        memtide()
            .args(["run", "-q", "--dram", "8MiB", "--tier"])
            .arg(s.path())
            .args(["--", "python3"])
            .arg(&script),
        Duration::from_secs(120),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout), native);
}
