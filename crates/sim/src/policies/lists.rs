//! Building blocks of the reference policies: which pages are in DRAM (and what their arrival
//! and departure count in an [`Outcome`]), and doubly linked lists threaded through per-page
//! arrays, so that a page can sit on one of several lists without any allocation per page.

use super::{Outcome, DIRTY, IN_DRAM, NEVER, NIL, OUT};

/// Which pages are in DRAM, which were touched before, which were written since they were
/// last in tier 1.
pub(super) struct Residency {
    state: Vec<u8>,
}

impl Residency {
    pub fn new(pages: u64) -> Residency {
        Residency {
            state: vec![NEVER; pages as usize],
        }
    }

    pub fn resident(&self, p: u32) -> bool {
        self.state[p as usize] & 3 == IN_DRAM
    }

    /// Page `p` comes into DRAM: a first touch or a miss.
    pub fn arrive(&mut self, p: u32, o: &mut Outcome) {
        let st = self.state[p as usize];
        if st & 3 == NEVER {
            o.first_touches += 1;
        } else {
            o.missed(p);
        }
        self.state[p as usize] = IN_DRAM | (st & DIRTY);
    }

    /// Page `p` leaves DRAM (written back if it was written since it was last in tier 1).
    pub fn leave(&mut self, p: u32, o: &mut Outcome) {
        o.demotions += 1;
        if self.state[p as usize] & DIRTY != 0 {
            o.writebacks += 1;
        }
        self.state[p as usize] = OUT;
        o.left(p);
    }

    pub fn write(&mut self, p: u32) {
        self.state[p as usize] |= DIRTY;
    }

    pub fn bytes(&self) -> u64 {
        self.state.len() as u64
    }
}

/// A list's ends and length; the links live in [`Links`]. The head is the newest end.
#[derive(Clone, Copy, Debug)]
pub(super) struct List {
    pub head: u32,
    pub tail: u32,
    pub len: u64,
}

impl List {
    pub const EMPTY: List = List {
        head: NIL,
        tail: NIL,
        len: 0,
    };
}

/// Links for lists of pages; each page is on at most one list at a time.
pub(super) struct Links {
    /// Towards the head (newer).
    newer: Vec<u32>,
    /// Towards the tail (older).
    older: Vec<u32>,
}

impl Links {
    pub fn new(pages: u64) -> Links {
        Links {
            newer: vec![NIL; pages as usize],
            older: vec![NIL; pages as usize],
        }
    }

    pub fn push_head(&mut self, l: &mut List, p: u32) {
        self.newer[p as usize] = NIL;
        self.older[p as usize] = l.head;
        if l.head != NIL {
            self.newer[l.head as usize] = p;
        }
        l.head = p;
        if l.tail == NIL {
            l.tail = p;
        }
        l.len += 1;
    }

    pub fn remove(&mut self, l: &mut List, p: u32) {
        let (a, b) = (self.newer[p as usize], self.older[p as usize]);
        if a == NIL {
            l.head = b;
        } else {
            self.older[a as usize] = b;
        }
        if b == NIL {
            l.tail = a;
        } else {
            self.newer[b as usize] = a;
        }
        l.len -= 1;
    }

    pub fn pop_tail(&mut self, l: &mut List) -> Option<u32> {
        let t = l.tail;
        if t == NIL {
            return None;
        }
        self.remove(l, t);
        Some(t)
    }

    /// The page one step towards the head from `p` ([`NIL`] at the head).
    pub fn newer(&self, p: u32) -> u32 {
        self.newer[p as usize]
    }

    pub fn bytes(&self) -> u64 {
        (self.newer.len() * 8) as u64
    }
}
