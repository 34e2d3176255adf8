//! The CLOCK sweep the engine runs by default (`sweep`), over the simulator's page states.
//! Entry point: [`Sweep`].

use memtide_policy::{Activeness, EpochClock, Relieve, SweepPages, Watermarks};

use super::{Outcome, Policy, DIRTY, IN_DRAM, LOOKAHEAD, NEVER, OUT, STAGED};

/// The engine's default policy (the other is [`super::Placement`]): pages faulted in are mapped
/// and invisible until the CLOCK sweep (the policy crate's [`memtide_policy::Sweep`] over [`Activeness`] histories) unmaps the idlest
/// into an inactive FIFO; touching an inactive page is a soft fault that promotes it; the FIFO's
/// oldest pages go to tier 1 when DRAM passes the [`Watermarks`] — the policy crate's own
/// pressure relief ([`Watermarks::relieve`]) drives both, over this simulator's page states, as
/// the engine's evictor drives them over its page table. Epochs come from the policy crate's
/// [`EpochClock`] on simulated time: each access costs `access_ns`, each miss `miss_ns` more.
pub struct Sweep {
    state: Vec<u8>,
    hist: Vec<Activeness>,
    /// The epoch each page's history was last brought up to date in: histories age lazily,
    /// when a page is next looked at (the same shifts the engine applies every epoch, without
    /// a pass over every page per epoch).
    aged_at: Vec<u32>,
    /// Inactive FIFO of pages (stale entries skipped: their state says so).
    fifo: std::collections::VecDeque<u32>,
    staged: u64,
    resident: u64,
    wm: Watermarks,
    sweep: memtide_policy::Sweep,
    clock: EpochClock,
    now_ns: u64,
    access_ns: u64,
    miss_ns: u64,
    touched_max: usize,
}

/// How many times in a row the sweep found a page in use ([`memtide_policy::sweep::MAX_PROVEN`]),
/// as the engine keeps it in its page words: one more for each touch while inactive, none once
/// the page leaves DRAM.
const PROVEN_SHIFT: u8 = 4;
const PROVEN: u8 = 3 << PROVEN_SHIFT;
const _: () = assert!(
    memtide_policy::sweep::MAX_PROVEN <= 3,
    "two bits hold the count"
);

fn proven_once_more(state: u8) -> u8 {
    let k = ((state & PROVEN) >> PROVEN_SHIFT) + 1;
    (state & !PROVEN) | (k.min(memtide_policy::sweep::MAX_PROVEN) << PROVEN_SHIFT)
}

/// Page `i`'s history as of epoch `now`, brought up to date.
fn history(hist: &mut [Activeness], aged_at: &mut [u32], now: u32, i: usize) -> Activeness {
    let behind = now.wrapping_sub(aged_at[i]);
    if behind != 0 {
        hist[i] = hist[i].aged(behind as u64);
        aged_at[i] = now;
    }
    hist[i]
}

/// The simulator's pages as the policy's sweep sees them: pages in DRAM and mapped are
/// candidates; taking one puts it at the back of the inactive FIFO.
struct Candidates<'a> {
    state: &'a mut [u8],
    hist: &'a mut [Activeness],
    aged_at: &'a mut [u32],
    now: u32,
    fifo: &'a mut std::collections::VecDeque<u32>,
    staged: &'a mut u64,
    extent: usize,
}

impl SweepPages for Candidates<'_> {
    fn extent(&self) -> usize {
        self.extent
    }

    fn candidate(&mut self, i: usize) -> Option<Activeness> {
        (self.state[i] & 3 == IN_DRAM).then(|| history(self.hist, self.aged_at, self.now, i))
    }

    fn take(&mut self, i: usize) -> bool {
        self.state[i] = (self.state[i] & !3) | STAGED;
        self.fifo.push_back(i as u32);
        *self.staged += 1;
        true
    }

    fn proven(&self, i: usize) -> u8 {
        (self.state[i] & PROVEN) >> PROVEN_SHIFT
    }
}

/// The simulator as the policy's pressure relief drives it; write-backs are counted in `o`.
struct Pressure<'a> {
    m: &'a mut Sweep,
    o: &'a mut Outcome,
}

impl Relieve for Pressure<'_> {
    fn resident(&self) -> u64 {
        self.m.resident
    }

    fn inactive(&self) -> u64 {
        self.m.staged
    }

    fn deactivate(&mut self, want: u64) -> u64 {
        let m = &mut *self.m;
        let mut pages = Candidates {
            state: &mut m.state,
            hist: &mut m.hist,
            aged_at: &mut m.aged_at,
            now: m.clock.epoch() as u32,
            fifo: &mut m.fifo,
            staged: &mut m.staged,
            extent: m.touched_max,
        };
        let n = m.sweep.deactivate(&mut pages, want as usize) as u64;
        self.o.deactivations += n;
        n
    }

    fn write_back(&mut self, batch: u64) -> u64 {
        let m = &mut *self.m;
        let mut moved = 0;
        while moved < batch {
            let Some(p) = m.fifo.pop_front() else {
                break;
            };
            let p = p as usize;
            if m.state[p] & 3 != STAGED {
                continue;
            }
            self.o.demotions += 1;
            if m.state[p] & DIRTY != 0 {
                self.o.writebacks += 1;
            }
            m.state[p] = OUT;
            self.o.left(p as u32);
            m.staged -= 1;
            m.resident -= 1;
            moved += 1;
        }
        moved
    }
}

impl Sweep {
    pub fn new(pages: u64, cap: u64, access_ns: u64, miss_ns: u64, epoch_ns: u64) -> Sweep {
        Sweep {
            state: vec![NEVER; pages as usize],
            hist: vec![Activeness(0); pages as usize],
            aged_at: vec![0; pages as usize],
            fifo: Default::default(),
            staged: 0,
            resident: 0,
            wm: Self::watermarks(cap),
            sweep: memtide_policy::Sweep::default(),
            clock: EpochClock::new(epoch_ns),
            now_ns: 0,
            access_ns,
            miss_ns,
            touched_max: 0,
        }
    }

    fn touch(&mut self, i: usize) {
        let h = history(
            &mut self.hist,
            &mut self.aged_at,
            self.clock.epoch() as u32,
            i,
        );
        self.hist[i] = h.touch();
    }

    /// The engine's watermarks for a quota of `cap` pages (at least 16).
    fn watermarks(cap: u64) -> Watermarks {
        Watermarks::for_quota(cap.max(16))
    }

    fn relieve(&mut self, o: &mut Outcome) {
        let wm = self.wm;
        wm.relieve(&mut Pressure { m: self, o });
    }
}

impl Policy for Sweep {
    fn name(&self) -> &'static str {
        "sweep"
    }
    fn access_batch(&mut self, batch: &[u64], o: &mut Outcome) {
        batch_with_lookahead!(self, batch, o, state)
    }
    fn state_bytes(&self) -> u64 {
        (self.state.len() * 2 + self.aged_at.len() * 4 + self.fifo.capacity() * 4) as u64
    }
    fn set_capacity(&mut self, cap: u64) -> bool {
        // Pages over the new quota leave at the next page brought in, as in the engine's
        // next relief.
        self.wm = Self::watermarks(cap);
        true
    }
    fn access(&mut self, page: u64, write: bool, o: &mut Outcome) {
        let p = page as usize;
        self.now_ns += self.access_ns;
        self.clock.tick(self.now_ns);
        let st = self.state[p];
        match st & 3 {
            IN_DRAM => {}
            STAGED => {
                o.soft_faults += 1;
                self.state[p] = proven_once_more((st & !3) | IN_DRAM);
                self.staged -= 1;
                self.touch(p);
            }
            s => {
                if s == NEVER {
                    o.first_touches += 1;
                    self.touched_max = self.touched_max.max(p + 1);
                } else {
                    o.missed(p as u32);
                    self.now_ns += self.miss_ns;
                }
                self.state[p] = IN_DRAM;
                self.touch(p);
                self.resident += 1;
                self.relieve(o);
            }
        }
        if write {
            self.state[p] |= DIRTY;
        }
    }
}
