//! memtide's mechanism: managed memory in a userfaultfd-registered arena, faults served by
//! per-CPU handler threads (or in the faulting thread, from SIGBUS), eviction to a tier-1 file
//! that never loses a write. All `unsafe` in memtide lives in this crate. Entry point: [`Engine::start`].

mod arena;
mod engine;
pub mod fds;
pub mod inject;
pub mod launch;
mod pages;
pub mod say;
pub mod signal;
pub mod size;
pub mod stats;
pub mod sys;
pub mod threads;
pub mod tier;
pub mod uffd;

pub use engine::{
    process_rss_bytes, Compress, Config, Engine, Event, EvictionPolicy, ForkPlan, MemError,
    PageInfo, Pinned, StartError,
};
pub use signal::Fault;
pub use stats::Snapshot;
pub use tier::TierOpenError;
pub use uffd::{Delivery, OpenError};
