//! End to end: the reserve-then-commit pattern of VMMs and managed runtimes, driven directly
//! (python with ctypes, the way QEMU and the JVM make these calls): a PROT_NONE reservation is
//! managed; MAP_FIXED read-write commits keep their data through eviction; a decommit
//! (MAP_FIXED PROT_NONE) and recommit reads zeros; a file mapped with MAP_FIXED into the
//! reservation shows the file; unmapped and replaced by anonymous memory, that range reads
//! zeros and takes writes. Every check is also run natively, where it must hold too.

mod common;

use std::process::Command;
use std::time::Duration;

use common::{main_stats, memtide, natively, output_within, require, stderr, Scratch};

const SCRIPT: &str = r#"import ctypes, ctypes.util, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
PROT_NONE, PROT_READ, PROT_WRITE = 0, 1, 2
MAP_PRIVATE, MAP_FIXED, MAP_ANON, MAP_NORESERVE = 0x02, 0x10, 0x20, 0x4000
MIB = 1 << 20
FAILED = ctypes.c_void_p(-1).value

def mmap(addr, n, prot, flags, fd=-1, off=0):
    p = libc.mmap(addr, n, prot, flags, fd, off)
    if p == FAILED or p is None:
        sys.exit(f"mmap failed: {os.strerror(ctypes.get_errno())}")
    return p

def fill(addr, n, seed):
    buf = bytes((seed + i) % 251 for i in range(4096))
    for off in range(0, n, 4096):
        ctypes.memmove(addr + off, buf, 4096)

def check(addr, n, seed):
    buf = bytes((seed + i) % 251 for i in range(4096))
    return all(ctypes.string_at(addr + off, 4096) == buf for off in range(0, n, 4096))

def zeros(addr, n):
    z = bytes(4096)
    return all(ctypes.string_at(addr + off, 4096) == z for off in range(0, n, 4096))

file_path = sys.argv[1]
with open(file_path, "wb") as f:
    f.write(bytes(range(256)) * (4 * MIB // 256))
base = mmap(None, 64 * MIB, PROT_NONE, MAP_PRIVATE | MAP_ANON | MAP_NORESERVE)
# Commit the first 32 MiB and fill it (four times the budget the test gives).
assert mmap(base, 32 * MIB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANON | MAP_FIXED) == base
fill(base, 32 * MIB, 7)
# A file mapped over the next 4 MiB of the reservation.
fd = os.open(file_path, os.O_RDONLY)
at = base + 32 * MIB
assert mmap(at, 4 * MIB, PROT_READ, MAP_PRIVATE | MAP_FIXED, fd, 0) == at
os.close(fd)
file_ok = ctypes.string_at(at, 4 * MIB) == bytes(range(256)) * (4 * MIB // 256)
# Decommit the first 8 MiB, commit it again: zeros.
assert mmap(base, 8 * MIB, PROT_NONE, MAP_PRIVATE | MAP_ANON | MAP_FIXED | MAP_NORESERVE) == base
assert mmap(base, 8 * MIB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANON | MAP_FIXED) == base
recommit_zero = zeros(base, 8 * MIB)
# The file's range back to anonymous memory: zeros, writable.
assert libc.munmap(at, 4 * MIB) == 0
assert mmap(at, 4 * MIB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANON | MAP_FIXED) == at
back_zero = zeros(at, 4 * MIB)
fill(at, 4 * MIB, 3)
rest_ok = check(base + 8 * MIB, 24 * MIB, 7) and check(at, 4 * MIB, 3)
assert libc.munmap(base, 64 * MIB) == 0
print("file", file_ok, "recommit-zero", recommit_zero, "back-zero", back_zero, "rest", rest_ok)
"#;

const EXPECTED: &str = "file True recommit-zero True back-zero True rest True";

#[test]
fn reservations_commit_decommit_and_lend_like_natively() {
    require("python3");
    let s = Scratch::new("reserve");
    let script = s.path().join("reserve.py");
    std::fs::write(&script, SCRIPT).unwrap();
    let data = s.path().join("data");
    let native = natively(Command::new("python3").arg(&script).arg(&data));
    assert_eq!(native.trim(), EXPECTED);
    let stats = s.path().join("stats.json");
    let o = output_within(
        memtide()
            .args(["run", "--dram", "8MiB", "--min-bytes", "1MiB", "--tier"])
            .arg(s.path())
            .arg("--stats")
            .arg(&stats)
            .args(["--", "python3"])
            .arg(&script)
            .arg(&data),
        Duration::from_secs(120),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), EXPECTED);
    let st = main_stats(&stats);
    assert!(
        st["peak_managed_bytes"].as_u64().unwrap() >= 64 << 20,
        "the reservation is managed: {st}"
    );
    assert!(
        st["tier_write_bytes"].as_u64().unwrap() >= 16 << 20,
        "the committed memory went through tier 1: {st}"
    );
}
