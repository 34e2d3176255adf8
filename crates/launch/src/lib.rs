//! What starting a program under memtide needs besides the engine's own half
//! (`memtide_engine::launch`): the flag parsers every subcommand shares ([`opts`]), the checks
//! before a launch ([`preflight`]), the summary after a run ([`summary`]), what /proc says of
//! the program's processes ([`procs`]) and the link to the host daemon ([`host_link`]). `memtide run`,
//! `memtide demo`, `memtide bench` and the host daemon's tenants all start programs through
//! these; the measurement laboratory (`memtide-bench`) depends on this crate, never the reverse.

pub mod host_link;
pub mod opts;
pub mod preflight;
pub mod procs;
pub mod summary;
