//! memtide's placement ([`memtide_policy::Placement`]) replayed with exactly the engine's view:
//! an access to a mapped page is invisible; the policy hears of first touches, misses and
//! accesses to pages it staged (hint faults, counted as soft faults). Eviction runs between
//! the engine's [`Watermarks`], and new pages are staged once DRAM nears the quota, as an
//! engine evictor running placement would.

use memtide_policy::{Pages, Placement, Residence, Watermarks};

use super::{Outcome, Policy, DIRTY, IN_DRAM, NEVER, OUT, STAGED};

/// The bits of a page's state that say where it is (`IN_DRAM`: in DRAM and mapped).
const WHERE: u8 = 3;

pub struct Tide {
    state: Vec<u8>,
    resident: u64,
    placement: Placement,
    wm: Watermarks,
}

impl Tide {
    pub fn new(pages: u64, cap: u64) -> Tide {
        let wm = Watermarks::for_quota(cap);
        Tide {
            state: vec![NEVER; pages as usize],
            resident: 0,
            placement: Placement::new(pages as usize, wm.quota),
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
            let want = *pages.resident - (wm.quota - wm.low_headroom);
            self.placement.evict(&mut pages, want);
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
        }
        true
    }

    fn evict(&mut self, i: usize) -> bool {
        self.o.demotions += 1;
        if self.state[i] & DIRTY != 0 {
            self.o.writebacks += 1;
        }
        self.state[i] = OUT;
        *self.resident -= 1;
        true
    }
}

impl Policy for Tide {
    fn name(&self) -> &'static str {
        "memtide"
    }

    fn state_bytes(&self) -> u64 {
        self.state.len() as u64 * (1 + Placement::BYTES_PER_PAGE)
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
                    o.misses += 1;
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
