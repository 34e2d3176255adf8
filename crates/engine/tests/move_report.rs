//! The kernel's report of a `UFFDIO_MOVE` that stops part-way matches its page tables: the
//! engine's eviction relies on knowing exactly which pages left the program's view. (It no
//! longer relies on the count alone — after a failed move it reads the page tables — but a
//! kernel that reports wrongly is worth knowing about.)

use memtide_engine::sys::{self, Mapping, Presence};
use memtide_engine::uffd::Uffd;

const PAGE: usize = 4096;
const PAGES: usize = 64;

fn presence(addr: usize) -> Vec<Presence> {
    let mut v = vec![Presence::Absent; PAGES];
    sys::presence(addr, &mut v).unwrap();
    v
}

/// Moves 64 filled pages onto a destination whose page `block` is already occupied, or from
/// a source with a hole at `block`; returns (reported pages moved, source, destination).
fn partial_move(occupied_dst: bool, block: usize) -> (usize, Vec<Presence>, Vec<Presence>) {
    let uffd = Uffd::open().expect("userfaultfd");
    let src = Mapping::anon(PAGES * PAGE).unwrap();
    let dst = Mapping::anon(PAGES * PAGE).unwrap();
    for m in [&src, &dst] {
        uffd.register(m.addr(), m.len()).unwrap();
        sys::lock_on_fault(m.addr(), m.len()).unwrap();
    }
    let page = vec![0xa5u8; PAGE];
    for i in 0..PAGES {
        if !occupied_dst && i == block {
            continue;
        }
        // SAFETY: the source range is ours, registered and missing here.
        unsafe { uffd.copy(src.addr() + i * PAGE, page.as_ptr() as usize, PAGE) }.unwrap();
    }
    if occupied_dst {
        // SAFETY: as above, in the destination.
        unsafe { uffd.copy(dst.addr() + block * PAGE, page.as_ptr() as usize, PAGE) }.unwrap();
    }
    // SAFETY: both ranges are ours and registered.
    let r = unsafe { uffd.move_pages(dst.addr(), src.addr(), PAGES * PAGE) };
    let done = match r {
        Ok(()) => PAGES,
        Err(e) => e.done / PAGE,
    };
    (done, presence(src.addr()), presence(dst.addr()))
}

#[test]
fn a_stopped_move_reports_what_it_moved() {
    for block in [0, 1, 10, 31, 63] {
        for occupied_dst in [true, false] {
            let (done, src, dst) = partial_move(occupied_dst, block);
            assert_eq!(done, block, "the move stops at the page it cannot move");
            for i in 0..PAGES {
                let moved = i < done;
                let hole = !occupied_dst && i == block;
                assert_eq!(
                    src[i] == Presence::Absent,
                    moved || hole,
                    "source page {i} (stopped at {block}, occupied destination {occupied_dst})"
                );
                assert_eq!(
                    dst[i] != Presence::Absent,
                    moved || (occupied_dst && i == block),
                    "destination page {i} (stopped at {block}, occupied destination {occupied_dst})"
                );
            }
        }
    }
}
