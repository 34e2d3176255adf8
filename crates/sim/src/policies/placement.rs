//! memtide's placement ([`memtide_policy::Placement`]) replayed with exactly the engine's view:
//! an access to a mapped page is invisible; the policy hears of first touches, misses and
//! accesses to pages it staged (hint faults, counted as soft faults). As `placement`, eviction
//! runs between the engine's [`Watermarks`] (one to two write-back batches below the quota,
//! so that a faulting thread rarely waits), and new pages are staged once DRAM nears the
//! quota, as an engine evictor running placement would. As `placement-exact`, it keeps exactly
//! as many pages in DRAM as every other policy does between accesses (evicting one page when
//! one more comes in, which may be that page, once used, as in the engine): the placement
//! decisions alone, for comparing policies.

use memtide_policy::{self as policy, Pages, Residence, Watermarks};

use super::{Outcome, Policy, DIRTY, IN_DRAM, NEVER, OUT, STAGED};

/// The bits of a page's state that say where it is (`IN_DRAM`: in DRAM and mapped).
const WHERE: u8 = 3;

pub struct Placement {
    name: &'static str,
    state: Vec<u8>,
    resident: u64,
    placement: policy::Placement,
    wm: Watermarks,
}

impl Placement {
    /// Placement as the engine runs it, between its watermarks.
    pub fn new(pages: u64, cap: u64) -> Placement {
        Placement::with(pages, Self::watermarks(false, cap), "placement")
    }

    /// Placement with exactly `cap` pages of DRAM in use, as the other policies have.
    pub fn exact(pages: u64, cap: u64) -> Placement {
        Placement::with(pages, Self::watermarks(true, cap), "placement-exact")
    }

    /// The engine's watermarks for a quota of `cap` pages, or (`exact`) none below it.
    fn watermarks(exact: bool, cap: u64) -> Watermarks {
        if exact {
            Watermarks {
                quota: cap.max(1),
                high_headroom: 0,
                low_headroom: 0,
                ..Watermarks::for_quota(cap)
            }
        } else {
            Watermarks::for_quota(cap)
        }
    }

    fn with(pages: u64, wm: Watermarks, name: &'static str) -> Placement {
        Placement {
            name,
            state: vec![NEVER; pages as usize],
            resident: 0,
            placement: policy::Placement::new(pages as usize, wm.quota),
            wm,
        }
    }

    /// What the engine's evictor does after a page comes in: over the high watermark, evicts
    /// down to the low one; near the quota, stages the pages that came in.
    fn relieve(&mut self, o: &mut Outcome) {
        let wm = self.wm;
        let mut pages = SimPages {
            state: &mut self.state,
            resident: &mut self.resident,
            o,
        };
        if wm.over_high(*pages.resident) {
            // One call may free fewer pages than asked (the hand spends a pass of credit, a pass
            // staging, and takes a page on the next): call again, as the engine's evictor does,
            // while it makes progress, until DRAM is down to the low watermark.
            while *pages.resident + wm.low_headroom > wm.quota {
                let want = *pages.resident + wm.low_headroom - wm.quota;
                let e = self.placement.evict(&mut pages, want);
                if e.total() == 0 && e.staged == 0 && e.promoted == 0 {
                    break;
                }
            }
        }
        if *pages.resident + wm.low_headroom + wm.inactive_target >= wm.quota {
            self.placement.probe(&mut pages, u64::MAX);
        }
    }
}

/// The simulator's pages as placement moves them; evictions are counted in `o`.
struct SimPages<'a> {
    state: &'a mut [u8],
    resident: &'a mut u64,
    o: &'a mut Outcome,
}

impl Pages for SimPages<'_> {
    fn residence(&mut self, i: usize) -> Residence {
        match self.state[i] & WHERE {
            IN_DRAM => Residence::Mapped,
            STAGED => Residence::Staged,
            _ => Residence::Busy,
        }
    }

    fn stage(&mut self, i: usize) -> bool {
        let st = &mut self.state[i];
        if *st & WHERE == IN_DRAM {
            *st = (*st & !WHERE) | STAGED;
            self.o.deactivations += 1;
        }
        true
    }

    fn evict(&mut self, i: usize) -> bool {
        self.o.demotions += 1;
        if self.state[i] & DIRTY != 0 {
            self.o.writebacks += 1;
        }
        self.state[i] = OUT;
        self.o.left(i as u32);
        *self.resident -= 1;
        true
    }
}

impl Placement {
    /// Pages in DRAM (mapped or staged).
    #[cfg(test)]
    pub(super) fn resident(&self) -> u64 {
        self.resident
    }
}

impl Policy for Placement {
    fn name(&self) -> &'static str {
        self.name
    }

    fn state_bytes(&self) -> u64 {
        self.state.len() as u64 * (1 + policy::Placement::BYTES_PER_PAGE)
    }

    fn set_capacity(&mut self, cap: u64) -> bool {
        self.wm = Self::watermarks(self.name == "placement-exact", cap.max(1));
        self.placement.set_quota(self.wm.quota);
        true
    }

    fn access(&mut self, page: u64, write: bool, o: &mut Outcome) {
        let p = page as usize;
        let st = self.state[p];
        match st & WHERE {
            IN_DRAM => {}
            STAGED => {
                // A hint fault: the page is used, and mapped again.
                o.soft_faults += 1;
                self.state[p] = (st & !WHERE) | IN_DRAM;
            }
            w => {
                if w == NEVER {
                    o.first_touches += 1;
                } else {
                    o.missed(p as u32);
                }
                self.state[p] = IN_DRAM | (st & DIRTY);
                self.resident += 1;
                self.placement.arrived(p);
                self.relieve(o);
            }
        }
        if write {
            self.state[p] |= DIRTY;
        }
    }
}
