//! How much one fault brings in: read-ahead on a sequential run of tier-1 reads, and the
//! zero-fill of first touches. Policy (sizes and when), not mechanism. Entry points:
//! [`readahead_window`], [`zero_fill`].

/// Most pages read ahead on a sequential run of tier faults.
pub const READAHEAD: usize = 16;

/// Pages zero-filled together on a first touch that looks sequential (64 KiB).
pub const ZERO_CHUNK: usize = 16;

/// Pages a tier read brings in on the `run`-th fault of a sequential run: 1, 1, 2, 4, 8,
/// then [`READAHEAD`]. Two faults in a row are an object spanning two pages, not a stream.
pub fn readahead_window(run: usize) -> usize {
    if run < 3 {
        1
    } else {
        (1usize << (run - 2).min(8)).min(READAHEAD)
    }
}

/// Pages a first touch fills: a chunk when the touches look sequential (the page before is
/// mapped, or the page starts an allocation; or the page after is mapped), one otherwise, so
/// that random first touches do not spend DRAM on neighbours nobody asked for.
pub fn zero_fill(sequential: bool) -> usize {
    if sequential {
        ZERO_CHUNK
    } else {
        1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readahead_grows_with_the_sequential_run() {
        assert_eq!(readahead_window(1), 1);
        assert_eq!(readahead_window(2), 1);
        let w: Vec<usize> = (3..=8).map(readahead_window).collect();
        assert_eq!(w, [2, 4, 8, 16, 16, 16]);
        assert_eq!(readahead_window(usize::MAX), READAHEAD);
    }

    #[test]
    fn random_first_touches_fill_one_page() {
        assert_eq!(zero_fill(false), 1);
        assert_eq!(zero_fill(true), ZERO_CHUNK);
    }
}
