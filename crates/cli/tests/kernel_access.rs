//! End to end: programs whose memory the kernel reads and writes on their behalf, with most of
//! that memory evicted or never touched — each once failed under memtide with EFAULT ("Bad
//! address"), and each must now do what it does natively: python filling a buffer with
//! getrandom(2), GNU sort reading its input through stdio into a managed buffer (also with
//! faults delivered as signals, where memtide must pin the buffer: coreutils read with
//! `fread_unlocked`), stdio's block calls moving managed buffers four times the budget under
//! signal delivery, and fio doing io_uring I/O from a managed buffer pool larger than the DRAM
//! budget, verified.

mod common;

use std::process::Command;
use std::time::Duration;

use common::{memtide, output_within, require, stderr, Scratch};

fn tiered(dram: &str, tier: &std::path::Path, program: &[&str]) -> std::process::Output {
    tiered_with(dram, tier, "threads", program)
}

fn tiered_with(
    dram: &str,
    tier: &std::path::Path,
    faults: &str,
    program: &[&str],
) -> std::process::Output {
    output_within(
        memtide()
            .args(["run", "--dram", dram, "--faults", faults, "--tier"])
            .arg(tier)
            .arg("--")
            .args(program),
        Duration::from_secs(300),
    )
}

#[test]
fn getrandom_fills_a_buffer_four_times_the_budget() {
    require("python3");
    let s = Scratch::new("getrandom");
    // Under signal delivery python's getrandom(2) failed with "Bad address" before memtide
    // pinned its buffer.
    for faults in ["threads", "signal"] {
        let o = tiered_with(
            "64MiB",
            s.path(),
            faults,
            &[
                "python3",
                "-c",
                "import os\nb = os.urandom(300 << 20)\nprint(len(b), sum(1 for i in range(0, len(b), 4096) if b[i:i+64] != bytes(64)))",
            ],
        );
        assert!(o.status.success(), "{faults}: {}", stderr(&o));
        assert_eq!(
            String::from_utf8_lossy(&o.stdout).trim(),
            format!("{} {}", 300 << 20, 300 << 8),
            "{faults}: every page holds random bytes"
        );
    }
}

#[test]
fn sort_reads_its_input_into_managed_memory() {
    let s = Scratch::new("sort");
    let input = s.path().join("lines.txt");
    let mut text = String::new();
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    for _ in 0..600_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        text.push_str(&format!("{x:016x} {}\n", x % 1000));
    }
    std::fs::write(&input, text).unwrap();
    let native = Command::new("sort")
        .args(["-S", "256M"])
        .arg(&input)
        .output()
        .unwrap();
    assert!(native.status.success());
    // With signal delivery sort's `fread_unlocked` into its fresh buffer failed with "read
    // failed: Bad address" before memtide pinned that call's buffer.
    for faults in ["threads", "signal"] {
        let o = tiered_with(
            "16MiB",
            s.path(),
            faults,
            &["sort", "-S", "256M", input.to_str().unwrap()],
        );
        assert!(o.status.success(), "{faults}: {}", stderr(&o));
        assert!(
            o.stdout == native.stdout,
            "{faults}: the same sorted output as natively"
        );
    }
}

/// Writes a buffer of non-zero bytes, four times the budget, with each of stdio's block
/// calls (and `puts`, to the file as its standard output), reads it back with `fread` and
/// `fread_unlocked`, and prints for each call its return value and whether the bytes match.
const STDIO_BLOCK_CALLS: &str = r#"
import ctypes, hashlib, os, sys
libc = ctypes.CDLL(None)
libc.fopen.restype = ctypes.c_void_p
libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
for name in ("fwrite", "fwrite_unlocked", "fread", "fread_unlocked"):
    getattr(libc, name).argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_void_p]
    getattr(libc, name).restype = ctypes.c_size_t
for name in ("fputs", "fputs_unlocked"):
    getattr(libc, name).argtypes = [ctypes.c_void_p, ctypes.c_void_p]
libc.puts.argtypes = [ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
libc.fflush.argtypes = [ctypes.c_void_p]
d, n = sys.argv[1], int(sys.argv[2]) << 20
buf = ctypes.create_string_buffer(n + 1)
page = (hashlib.sha256(b"memtide").digest() * 128).replace(b"\0", b"\1")
for off in range(0, n, 4096):
    ctypes.memmove(ctypes.addressof(buf) + off, page, 4096)
    buf[off] = 1 + (off >> 12) % 255
want = hashlib.sha256(buf.raw[:n]).hexdigest()
def same(path, tail=b""):
    return hashlib.sha256(open(path, "rb").read()).hexdigest() == hashlib.sha256(buf.raw[:n] + tail).hexdigest()
out = []
for name in ("fwrite", "fwrite_unlocked", "fputs", "fputs_unlocked"):
    path = os.path.join(d, name)
    f = libc.fopen(path.encode(), b"wb")
    if name.startswith("fwrite"):
        r = getattr(libc, name)(buf, 1, n, f)
    else:
        r = getattr(libc, name)(buf, f)
    libc.fclose(f)
    out.append(f"{name} {r} {same(path)}")
for name in ("fread", "fread_unlocked"):
    back = ctypes.create_string_buffer(n)
    f = libc.fopen(os.path.join(d, "fwrite").encode(), b"rb")
    r = getattr(libc, name)(back, 4096, n // 4096, f)
    libc.fclose(f)
    out.append(f"{name} {r} {hashlib.sha256(back.raw).hexdigest() == want}")
path = os.path.join(d, "puts")
saved, fd = os.dup(1), os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
os.dup2(fd, 1)
r = libc.puts(buf)
libc.fflush(None)
os.dup2(saved, 1)
nl = same(path, b"\n")
out.append(f"puts {r} {nl}")
print("\n".join(out))
"#;

#[test]
fn stdio_block_calls_move_managed_buffers_with_signal_faults() {
    require("python3");
    let s = Scratch::new("stdio");
    let mib = 64;
    let n = mib << 20;
    let o = tiered_with(
        "16MiB",
        s.path(),
        "signal",
        &[
            "python3",
            "-c",
            STDIO_BLOCK_CALLS,
            s.path().to_str().unwrap(),
            &mib.to_string(),
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    // What each call returns natively: the items moved, 1 from fputs, the bytes from puts.
    let want = format!(
        "fwrite {n} True\nfwrite_unlocked {n} True\nfputs 1 True\nfputs_unlocked 1 True\n\
         fread {p} True\nfread_unlocked {p} True\nputs {} True",
        n + 1,
        p = n / 4096
    );
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).trim(),
        want,
        "{}",
        stderr(&o)
    );
    let err = stderr(&o);
    assert!(
        err.contains("from tier 1") && !err.contains(" 0 from tier 1"),
        "the buffer went through tier 1: {err}"
    );
}

#[test]
fn fio_io_uring_from_a_managed_buffer_pool_verifies() {
    require("fio");
    let s = Scratch::new("fio");
    let job = s.path().join("job.fio");
    // 64 buffers of 1 MiB (64 MiB of managed memory, twice the budget), written through
    // io_uring and read back and verified (crc32c). `thread`: fio's job runs as a thread of
    // the process that allocated the buffers.
    std::fs::write(
        &job,
        format!(
            "[global]\nthread=1\nioengine=io_uring\niomem=malloc\ndirect=1\nbs=1M\niodepth=64\n\
             size=256M\nfilename={}\nverify=crc32c\ndo_verify=1\nverify_state_save=0\n[write-verify]\nrw=write\n",
            s.path().join("data").display()
        ),
    )
    .unwrap();
    let o = tiered("32MiB", s.path(), &["fio", job.to_str().unwrap()]);
    let out = String::from_utf8_lossy(&o.stdout);
    let err = stderr(&o);
    assert!(o.status.success(), "{out}{err}");
    assert!(out.contains("err= 0"), "{out}");
    assert!(
        !out.contains("Bad address") && !err.contains("Bad address"),
        "{out}{err}"
    );
    assert!(
        err.contains("from tier 1") && !err.contains(" 0 from tier 1"),
        "the buffers went through tier 1: {err}"
    );
}
