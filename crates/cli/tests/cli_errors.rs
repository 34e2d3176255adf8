//! Bad input gets one clear line on stderr and a non-zero exit, and nothing is started or
//! left behind; the program's own exit status is passed through.

mod common;

use common::{fails_with, memtide, stderr, Scratch};

#[test]
fn dram_zero_and_garbage_and_too_large() {
    fails_with(&["run", "--dram", "0", "--", "true"], "must be more than 0");
    fails_with(&["run", "--dram", "lots", "--", "true"], "not a size");
    fails_with(
        &["run", "--dram", "100TiB", "--", "true"],
        "more than this machine's memory",
    );
}

/// A mistyped option before the program was taken for the program ("program `--compres`
/// not found in PATH"): it is named as an option memtide does not have, in one line.
#[test]
fn an_unknown_option_is_named_not_run() {
    for args in [
        &["run", "--dram", "64MiB", "--compres", "lz4", "--", "true"][..],
        &["run", "--dram", "64MiB", "--compres", "--", "true"][..],
        &["run", "--dram", "64MiB", "--nope"][..],
    ] {
        fails_with(args, "unexpected argument '--");
        let o = memtide().args(args).output().unwrap();
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        assert_eq!(stderr(&o).lines().count(), 1, "{}", stderr(&o));
        assert!(!stderr(&o).contains("not found in PATH"));
    }
    fails_with(
        &["run", "--", "true"],
        "required arguments were not provided: --dram",
    );
    // A program's own options after it, with or without `--`, are the program's.
    for args in [
        &["run", "--dram", "64MiB", "-q", "sh", "-c", "exit 3"][..],
        &["run", "--dram", "64MiB", "-q", "--", "sh", "-c", "exit 3"][..],
    ] {
        let o = memtide().args(args).output().unwrap();
        assert_eq!(o.status.code(), Some(3), "{args:?}: {}", stderr(&o));
    }
}

/// The compressed level's options: an unknown compressor, and a pool as large as the DRAM it
/// lives in.
#[test]
fn a_bad_compressor_or_pool_size_is_one_line() {
    fails_with(
        &[
            "run",
            "--dram",
            "64MiB",
            "--compress",
            "zstd9",
            "--",
            "true",
        ],
        "is not a compressor memtide has: write lz4, zstd or off",
    );
    fails_with(
        &[
            "run",
            "--dram",
            "64MiB",
            "--compressed-max",
            "64MiB",
            "--",
            "true",
        ],
        "the pool lives within the DRAM quota",
    );
    fails_with(
        &[
            "run",
            "--dram",
            "64MiB",
            "--compressed-max",
            "0",
            "--",
            "true",
        ],
        "must be more than 0",
    );
    fails_with(
        &[
            "run",
            "--dram",
            "64MiB",
            "--compressed-sizing",
            "elastic",
            "--",
            "true",
        ],
        "write fixed or adaptive",
    );
    fails_with(
        &[
            "run",
            "--dram",
            "64MiB",
            "--compress",
            "off",
            "--compressed-sizing",
            "adaptive",
            "--",
            "true",
        ],
        "which --compress off turns off",
    );
}

#[test]
fn tier_path_missing_existing_or_unwritable() {
    fails_with(
        &[
            "run",
            "--dram",
            "64MiB",
            "--tier",
            "/nonexistent/dir/x.tier",
            "--",
            "true",
        ],
        "does not exist",
    );
    let s = Scratch::new("errors");
    let f = s.path().join("taken.tier");
    std::fs::write(&f, b"user data").unwrap();
    fails_with(
        &[
            "run",
            "--dram",
            "64MiB",
            "--tier",
            f.to_str().unwrap(),
            "--",
            "true",
        ],
        "already exists",
    );
    assert_eq!(
        std::fs::read(&f).unwrap(),
        b"user data",
        "an existing file is never touched"
    );
    fails_with(
        &["run", "--dram", "64MiB", "--tier", "/proc", "--", "true"],
        "tier path /proc",
    );
}

#[test]
fn program_not_found() {
    fails_with(
        &["run", "--dram", "64MiB", "--", "no-such-program-xyz"],
        "not found",
    );
}

#[test]
fn exit_status_is_passed_through() {
    let o = memtide()
        .args([
            "run", "--dram", "64MiB", "--quiet", "--", "sh", "-c", "exit 7",
        ])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(7), "{}", stderr(&o));
}

#[test]
fn tier_without_o_direct_falls_back_and_says_so() {
    // ramfs has no O_DIRECT (tmpfs has it on current kernels). Mounting needs root, as CI is.
    let s = Scratch::new("ramfs");
    let mnt = s.path().join("rf");
    std::fs::create_dir(&mnt).unwrap();
    let m = std::process::Command::new("mount")
        .args(["-t", "ramfs", "none"])
        .arg(&mnt)
        .status()
        .unwrap();
    assert!(m.success(), "mounting a ramfs needs root");
    let o = memtide()
        .args(["run", "--dram", "16MiB", "--tier"])
        .arg(&mnt)
        .args([
            "--",
            "python3",
            "-c",
            "b = bytearray(range(256)) * (256 * 1024)\nassert b[12345678] == 12345678 % 256\nprint(sum(b[::4096]))",
        ])
        .output()
        .unwrap();
    let _ = std::process::Command::new("umount").arg(&mnt).status();
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("no O_DIRECT"), "{err}");
    assert!(
        err.contains("buffered"),
        "the summary says the tier is buffered: {err}"
    );
    let want: u64 = (0..64u64 << 20).step_by(4096).map(|i| i % 256).sum();
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), want.to_string());
}

#[test]
fn no_userfaultfd_permission_says_how_to_grant_it() {
    // Run memtide as an unprivileged user with the sysctl closed: the syscall and
    // /dev/userfaultfd (root-only) are both refused.
    let sysctl =
        std::fs::read_to_string("/proc/sys/vm/unprivileged_userfaultfd").unwrap_or_default();
    assert_eq!(
        sysctl.trim(),
        "0",
        "test expects vm.unprivileged_userfaultfd=0"
    );
    let bin = env!("CARGO_BIN_EXE_memtide");
    let o = std::process::Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            bin,
            "run",
            "--dram",
            "64MiB",
            "--tier",
            "/tmp",
            "--",
            "true",
        ])
        .output()
        .unwrap();
    let err = stderr(&o);
    assert!(!o.status.success());
    assert!(
        err.contains("vm.unprivileged_userfaultfd") && err.contains("/dev/userfaultfd"),
        "{err}"
    );
}

/// `--bgsave` asks for redis's snapshots: memcached has none.
#[test]
fn bgsave_outside_redis_is_one_line() {
    fails_with(
        &["bench", "--experiments", "memcached", "--bgsave"],
        "--bgsave: only redis saves snapshots",
    );
}
