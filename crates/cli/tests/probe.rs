//! `memtide probe` end to end: its QD1 and QD32 random read rates agree with fio's on the same
//! file within 25%, the report says what it measured, and bad paths are one-line errors.

mod common;

use std::process::Command;

use common::{fails_with, memtide, require, stderr, Scratch};

/// fio's random 4 KiB read IOPS on `file` at `depth`, O_DIRECT through io_uring.
fn fio_iops(file: &str, depth: u32) -> f64 {
    let o = Command::new("fio")
        .args([
            "--name=probe-check",
            "--direct=1",
            "--rw=randread",
            "--bs=4k",
            "--ioengine=io_uring",
            "--time_based",
            "--runtime=4",
            "--output-format=json",
        ])
        .arg(format!("--filename={file}"))
        .arg(format!("--iodepth={depth}"))
        .output()
        .unwrap();
    assert!(o.status.success(), "fio: {}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    v["jobs"][0]["read"]["iops"].as_f64().unwrap()
}

#[test]
fn agrees_with_fio_on_the_same_file() {
    require("fio");
    // This machine's virtual disk has moments of drift that fio's before-and-after bracket
    // does not always catch (CI once saw the probe at 56 K IOPS at QD32 between fio's 81 K
    // and 79 K, and agreeing when run again): a disagreement is measured once more, from
    // scratch, and only a second one fails.
    if let Err(first) = agreement() {
        eprintln!("first attempt disagreed ({first}); measuring again");
        if let Err(second) = agreement() {
            panic!("{second} (first attempt: {first})");
        }
    }
}

/// One bracketed comparison: fio, the probe, fio again; the probe's figures checked.
fn agreement() -> Result<(), String> {
    let s = Scratch::new("probe");
    let json = s.path().join("probe.json");
    // fio's "before" figures: on a file of the same size that fio lays out itself in the same
    // directory (the probe's own file exists only once the probe has run).
    let before = s.path().join("fio-before");
    std::fs::write(&before, vec![0x5au8; 512 << 20]).unwrap();
    let before = before.to_str().unwrap().to_string();
    let fio_before = [fio_iops(&before, 1), fio_iops(&before, 32)];
    let _ = std::fs::remove_file(&before);
    let o = memtide()
        .args(["probe", "--size", "512MiB", "--keep-file", "--json"])
        .arg(&json)
        .arg(s.path())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("verdict: "), "{out}");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    // The wake-up figures: with two CPUs both are measured, and the printed line calls the
    // wake-up across CPUs slow exactly when the JSON's figures are (over 10 µs and 4x the
    // one on the same CPU).
    if std::thread::available_parallelism().map_or(1, |n| n.get()) >= 2 {
        let same = v["wake_same_cpu_us"].as_f64().unwrap();
        let other = v["wake_other_cpu_us"].as_f64().unwrap();
        assert!(same > 0.0 && other > 0.0, "{v}");
        let line = out.lines().find(|l| l.starts_with("waking a thread"));
        let line = line.unwrap_or_else(|| panic!("no wake-up line: {out}"));
        assert_eq!(
            line.contains("slow"),
            other > 10.0 && other > 4.0 * same,
            "{line} / {v}"
        );
    }
    let file = v["test_file"].as_str().unwrap().to_string();
    assert!(std::path::Path::new(&file).exists(), "--keep-file keeps it");
    let ours_qd1 = v["read_qd1"]["iops"].as_f64().unwrap();
    let ours_qd32 = v["read_iops_qd32"].as_f64().unwrap();
    let p50 = v["read_qd1"]["p50_us"].as_f64().unwrap();
    let p99 = v["read_qd1"]["p99_us"].as_f64().unwrap();
    assert!(p50 > 0.0 && p99 >= p50, "{v}");
    assert!(
        ["green", "yellow", "red"].contains(&v["verdict"].as_str().unwrap()),
        "{v}"
    );
    assert!(
        ours_qd32 > ours_qd1,
        "a deeper queue serves more reads: {v}"
    );
    // This machine's disk drifts by more than 25% over a minute at QD32 (CI once saw fio at
    // 43 K IOPS right after the probe measured 55 K), so fio measures both before and after
    // the probe's read stages and the probe must agree with the device as fio found it on
    // either side of them: within 25% of the range fio's two runs span.
    let fio_after = [fio_iops(&file, 1), fio_iops(&file, 32)];
    let _ = std::fs::remove_file(&file);
    eprintln!(
        "QD1 memtide {ours_qd1:.0} fio {:.0}/{:.0}; QD32 memtide {ours_qd32:.0} fio {:.0}/{:.0}",
        fio_before[0], fio_after[0], fio_before[1], fio_after[1]
    );
    for (i, (what, ours)) in [("QD1", ours_qd1), ("QD32", ours_qd32)]
        .into_iter()
        .enumerate()
    {
        let lo = fio_before[i].min(fio_after[i]);
        let hi = fio_before[i].max(fio_after[i]);
        if !(ours >= 0.75 * lo && ours <= 1.25 * hi) {
            return Err(format!(
                "{what}: memtide probe {ours:.0} IOPS vs fio {lo:.0}..{hi:.0} IOPS (before and after)"
            ));
        }
    }
    Ok(())
}

#[test]
fn bad_paths_are_one_line() {
    fails_with(
        &["probe", "--quick", "/nonexistent/dir"],
        "no such directory",
    );
    fails_with(&["probe", "--quick", "/etc/hostname"], "not a directory");
    // A read-only filesystem, a full one, and one without O_DIRECT: mounting needs root, as
    // CI is.
    let s = Scratch::new("probemnt");
    let ro = Mount::new(
        s.path(),
        "ro",
        &["-t", "tmpfs", "-o", "ro,size=64m", "none"],
    );
    let full = Mount::new(s.path(), "full", &["-t", "tmpfs", "-o", "size=4m", "none"]);
    let ramfs = Mount::new(s.path(), "ramfs", &["-t", "ramfs", "none"]);
    fails_with(&["probe", "--quick", &ro.0], "not writable");
    fails_with(&["probe", "--quick", "--size", "64MiB", &full.0], "no room");
    fails_with(&["probe", "--quick", &ramfs.0], "does not support O_DIRECT");
    // Nothing left behind.
    assert_eq!(std::fs::read_dir(&full.0).unwrap().count(), 0);
    assert_eq!(std::fs::read_dir(&ramfs.0).unwrap().count(), 0);
}

/// A filesystem mounted for a test, unmounted when dropped.
struct Mount(String);

impl Mount {
    fn new(base: &std::path::Path, name: &str, args: &[&str]) -> Mount {
        let m = base.join(name);
        std::fs::create_dir_all(&m).unwrap();
        let ok = Command::new("mount")
            .args(args)
            .arg(&m)
            .status()
            .unwrap()
            .success();
        assert!(ok, "mount {args:?} needs root");
        Mount(m.to_str().unwrap().to_string())
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}
