//! The statistics directory of a launch is private whatever the umask: anyone who could write
//! in it could change the program's quota and tier size (the `quota` and `tier` files) or forge
//! its figures. Its own test binary, since the umask is per process.

use std::os::unix::fs::{MetadataExt, PermissionsExt};

use memtide_engine::launch::{ask_quota, StatsDir, QUOTA_FILE};

/// Sets the umask, returning the one before.
fn umask(mask: u32) -> u32 {
    // SAFETY: umask has no preconditions.
    unsafe { libc::umask(mask as libc::mode_t) as u32 }
}

#[test]
fn the_stats_directory_is_private_under_any_umask() {
    for mask in [0o000, 0o022, 0o277] {
        let before = umask(mask);
        let made = StatsDir::new();
        umask(before);
        let d = made.unwrap();
        let m = std::fs::metadata(&d.0).unwrap();
        assert_eq!(
            m.permissions().mode() & 0o777,
            0o700,
            "umask {mask:o} left the directory {:o}",
            m.permissions().mode() & 0o777
        );
        // SAFETY: geteuid has no preconditions.
        assert_eq!(m.uid(), unsafe { libc::geteuid() });
        // The launcher can still pass a quota on through it.
        ask_quota(&d.0, 1 << 30).unwrap();
        assert_eq!(
            std::fs::read_to_string(d.0.join(QUOTA_FILE)).unwrap(),
            "1073741824\n"
        );
    }
}
