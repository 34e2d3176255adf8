//! The arena's address-space allocator: which page ranges of the arena are handed out to the
//! program. First fit over a map of free ranges, merged on free. Runs in the program's own
//! allocation calls, never on the fault path. Entry point: [`RangeAlloc`].

use std::collections::BTreeMap;

/// Free page ranges of an arena: start page → length in pages.
#[derive(Debug)]
pub struct RangeAlloc {
    free: BTreeMap<usize, usize>,
    /// One past the highest page ever handed out: scans stop here.
    high_water: usize,
}

impl RangeAlloc {
    pub fn new(pages: usize) -> RangeAlloc {
        let mut free = BTreeMap::new();
        free.insert(0, pages);
        RangeAlloc {
            free,
            high_water: 0,
        }
    }

    pub fn high_water(&self) -> usize {
        self.high_water
    }

    /// Allocates `pages` pages whose first page index is a multiple of `align` (pages).
    pub fn alloc(&mut self, pages: usize, align: usize) -> Option<usize> {
        let align = align.max(1);
        let (start, len, at) = self.free.iter().find_map(|(&start, &len)| {
            let at = start.next_multiple_of(align);
            (at + pages <= start + len).then_some((start, len, at))
        })?;
        self.take(start, len, at, pages);
        Some(at)
    }

    /// Allocates exactly `[at, at+pages)` if all of it is free.
    pub fn alloc_at(&mut self, at: usize, pages: usize) -> bool {
        let Some((&start, &len)) = self.free.range(..=at).next_back() else {
            return false;
        };
        if at + pages > start + len {
            return false;
        }
        self.take(start, len, at, pages);
        true
    }

    fn take(&mut self, start: usize, len: usize, at: usize, pages: usize) {
        self.free.remove(&start);
        if at > start {
            self.free.insert(start, at - start);
        }
        if at + pages < start + len {
            self.free.insert(at + pages, start + len - at - pages);
        }
        self.high_water = self.high_water.max(at + pages);
    }

    /// Returns `[start, start+pages)` (which must be allocated) to the free map.
    pub fn free(&mut self, mut start: usize, mut pages: usize) {
        if pages == 0 {
            return;
        }
        if let Some((&ps, &pl)) = self.free.range(..start).next_back() {
            debug_assert!(ps + pl <= start, "double free in arena");
            if ps + pl == start {
                self.free.remove(&ps);
                start = ps;
                pages += pl;
            }
        }
        if let Some(&nl) = self.free.get(&(start + pages)) {
            self.free.remove(&(start + pages));
            pages += nl;
        }
        self.free.insert(start, pages);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_free_merges_back_to_one_range() {
        let mut a = RangeAlloc::new(1000);
        let x = a.alloc(10, 1).unwrap();
        let y = a.alloc(20, 16).unwrap();
        assert_eq!(x, 0);
        assert_eq!(y % 16, 0);
        assert!(y >= 10);
        assert!(!a.alloc_at(y + 5, 1));
        assert!(a.alloc_at(y + 20, 5));
        a.free(x, 10);
        a.free(y + 20, 5);
        a.free(y, 20);
        assert_eq!(a.free.len(), 1);
        assert_eq!(a.free.get(&0), Some(&1000));
        assert!(a.alloc(1001, 1).is_none());
    }
}
