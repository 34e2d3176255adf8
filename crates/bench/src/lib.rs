//! memtide's measurement laboratory, and the pieces the `memtide` command's subcommands share.
//! The laboratory: `memtide demo` ([`demo`]), `memtide bench` ([`bench`], with its key-value
//! and multi-tenant experiments in [`kv`], [`tenants`], [`vms`] and [`quotas`]), the built-in workload they run
//! ([`workload`]), and `memtide probe` ([`probe`], over the O_DIRECT runners in [`device`]).
//! Shared: flag parsers ([`opts`]), checks before a launch ([`preflight`]), the run summary
//! ([`summary`]), SVG charts ([`plot`]) and report helpers ([`report`]). The `memtide` binary
//! only parses its command line and calls in here.

pub mod bench;
pub mod demo;
pub mod device;
pub mod kv;
pub mod opts;
pub mod plot;
pub mod preflight;
pub mod probe;
pub mod quotas;
pub mod report;
pub mod summary;
pub mod tenants;
pub mod vms;
pub mod workload;
