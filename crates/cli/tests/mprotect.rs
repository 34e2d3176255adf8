//! End to end: a program that protects part of its heap and makes it writable again, 300
//! times, while eviction runs over the rest (64 MiB block, 32 MiB of DRAM), then checks that a
//! write into a read-only page still kills a child with SIGSEGV. Under memtide it must print
//! what it prints natively (once the SIGSEGV on the write after making the range writable
//! again, once a hang when a pin per call reached its limit).

mod common;

use std::time::Duration;

use common::{main_stats, memtide, natively, output_within, require, stderr, Scratch};

const SCRIPT: &str = r#"
import ctypes, hashlib, os, signal
libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
PROT_READ, PROT_RW = 1, 3
N, M, PAGE = 64 << 20, 1 << 20, 4096
b = bytearray(N)
base = ctypes.addressof((ctypes.c_char * N).from_buffer(b))
off = ((base + 8 * PAGE + PAGE - 1) & ~(PAGE - 1)) - base
start = base + off
sums = 0
for r in range(300):
    if libc.mprotect(start, M, PROT_READ) != 0:
        raise OSError(ctypes.get_errno(), "mprotect read-only")
    sums += sum(b[off:off + M:PAGE])
    if libc.mprotect(start, M, PROT_RW) != 0:
        raise OSError(ctypes.get_errno(), "mprotect read-write")
    b[off + (r % 256) * PAGE:off + (r % 256 + 1) * PAGE] = bytes([r % 251 + 1]) * PAGE
    # Walk a quarter of the block so that eviction runs over the rest of it (offsets from
    # the protected range, so that the bytes do not depend on where malloc put the block).
    q = (r % 4) * (N // 4)
    for i in range(q, q + N // 4, PAGE):
        j = (off + i + 7) % N
        b[j] = (b[j] + 1) % 256
print(sums, hashlib.sha256(b[off:] + b[:off]).hexdigest())
# The protection keeps its meaning: writing into the read-only range kills the writer.
libc.mprotect(start, M, PROT_READ)
pid = os.fork()
if pid == 0:
    ctypes.memset(start + 5 * PAGE, 1, 1)
    os._exit(0)
_, status = os.waitpid(pid, 0)
print("child killed by SIGSEGV:", os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSEGV)
"#;

#[test]
fn mprotect_rounds_on_managed_memory_behave_as_natively() {
    require("python3");
    let s = Scratch::new("mprotect");
    let script = s.path().join("protect.py");
    std::fs::write(&script, SCRIPT).unwrap();
    let native = natively(std::process::Command::new("python3").arg(&script));
    assert!(native.contains("child killed by SIGSEGV: True"), "{native}");
    let stats = s.path().join("stats.json");
    let tiered = output_within(
        memtide()
            .args(["run", "--dram", "32MiB", "--tier"])
            .arg(s.path())
            .arg("--stats")
            .arg(&stats)
            .args(["--", "python3"])
            .arg(&script),
        Duration::from_secs(300),
    );
    assert!(tiered.status.success(), "{}", stderr(&tiered));
    assert_eq!(
        String::from_utf8_lossy(&tiered.stdout),
        native,
        "same output with and without memtide"
    );
    let st = main_stats(&stats);
    assert!(
        st["peak_managed_bytes"].as_u64().unwrap() >= 64 << 20,
        "the block was managed: {st}"
    );
    assert!(
        st["faults_tier"].as_u64().unwrap() > 0,
        "the walk went through tier 1: {st}"
    );
}
