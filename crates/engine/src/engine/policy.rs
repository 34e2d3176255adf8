//! The eviction interface: what a way of choosing the pages that leave DRAM asks of the engine
//! when it starts ([`Needs`]) and does for it in every round of the evictor ([`Evictor`]). The
//! CLOCK sweep (`evict.rs`) and placement (`place.rs`) each implement it once; the engine holds
//! the needs from its start and the evictor thread holds one `Box<dyn Evictor>`, so nothing
//! else in the engine asks which policy runs. A new policy is its decisions in the policy
//! crate, one implementation of [`Evictor`] here and one line in each match below.

use memtide_policy::Relief;

use super::evict::Sweeping;
use super::place::Placer;
use super::Engine;

/// Which pages the evictor takes out of DRAM (`--policy`, `MEMTIDE_POLICY`; the simulator
/// replays each under the same name).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EvictionPolicy {
    /// The CLOCK sweep over the page table ([`memtide_policy::Sweep`]): pages idle for the
    /// most epochs go to the inactive list (the staging ring) in address order, its oldest
    /// pages to tier 1.
    #[default]
    Sweep,
    /// The placement queues ([`memtide_policy::Placement`]): new pages on probation in a small
    /// FIFO queue, pages used again in a SIEVE queue, a staged page's hint fault as its
    /// reference bit.
    Placement,
}

impl EvictionPolicy {
    /// Every policy, in the order `--help` lists them.
    pub const ALL: [EvictionPolicy; 2] = [EvictionPolicy::Sweep, EvictionPolicy::Placement];

    /// The name `--policy`, `MEMTIDE_POLICY` and the simulator use.
    pub fn name(self) -> &'static str {
        match self {
            EvictionPolicy::Sweep => "sweep",
            EvictionPolicy::Placement => "placement",
        }
    }

    /// The policy of that name, or of an older spelling of it (`clock`; the simulator keeps
    /// that name for the classic CLOCK, so it replays this policy only as `sweep`).
    pub fn from_name(name: &str) -> Option<EvictionPolicy> {
        match name {
            "sweep" | "clock" => Some(EvictionPolicy::Sweep),
            "placement" => Some(EvictionPolicy::Placement),
            _ => None,
        }
    }

    /// What the policy asks of the engine, for a first quota of `quota_pages`.
    pub(super) fn needs(self, quota_pages: u64) -> Needs {
        match self {
            EvictionPolicy::Sweep => Needs::default(),
            // Placement keeps pages staged for a whole pass of its hand, most of DRAM at
            // times: room for four times the first quota. (Every slot the head passes keeps
            // its page tables, which whoever walks them — an audit, clear_refs — pays for; a
            // quota grown beyond that is served with pages put back from the ring's tail
            // early.) It hears of each page that comes in, and takes staged pages out of the
            // ring in its own order.
            EvictionPolicy::Placement => Needs {
                extra_staging: quota_pages.saturating_mul(4),
                arrivals: true,
                staged_out_of_order: true,
            },
        }
    }

    /// The policy's state in the evictor thread of `engine`.
    pub(super) fn evictor(self, engine: &Engine) -> Box<dyn Evictor> {
        match self {
            EvictionPolicy::Sweep => Box::new(Sweeping),
            EvictionPolicy::Placement => {
                Box::new(Placer::new(engine.pt.pages(), engine.quota.wm().quota))
            }
        }
    }
}

/// What a policy asks of the engine when it starts.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Needs {
    /// Staging slots beyond those of the inactive list the watermarks size.
    pub(super) extra_staging: u64,
    /// Whether the fault paths tell the evictor each page they bring in (the arrivals queue,
    /// `Engine::arrived`).
    pub(super) arrivals: bool,
    /// Whether staged pages leave the ring out of its order: a freed staged page then gives
    /// its slot back at once, as the ring's tail may not pass it for a long time.
    pub(super) staged_out_of_order: bool,
}

/// A policy's state in the evictor thread, driven once a round.
pub(super) trait Evictor: Send {
    /// Relieves pressure on DRAM as the policy decides: over the high watermark, takes pages
    /// out of DRAM (writing into `writing`, the evictor's batch) until resident memory is
    /// under the low one, waking waiting threads as room is made. `new_epoch` is set on the
    /// first round of each epoch.
    fn relieve(
        &mut self,
        engine: &Engine,
        writing: &mut Vec<(usize, u32)>,
        new_epoch: bool,
    ) -> Relief;
}

#[cfg(test)]
mod tests {
    use super::EvictionPolicy;

    #[test]
    fn every_policy_goes_by_its_name_and_clock_is_the_sweep() {
        for p in EvictionPolicy::ALL {
            assert_eq!(EvictionPolicy::from_name(p.name()), Some(p));
        }
        assert_eq!(
            EvictionPolicy::from_name("clock"),
            Some(EvictionPolicy::Sweep)
        );
        assert_eq!(EvictionPolicy::from_name("lru"), None);
    }
}
