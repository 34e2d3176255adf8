//! memtide's measurement laboratory, and the pieces the `memtide` command's subcommands share.
//! The laboratory: `memtide demo` ([`demo`]), `memtide bench` ([`bench`], with its key-value
//! and multi-tenant experiments in [`kv`], [`tenants`], [`vms`] and [`quotas`]), the built-in workload they run
//! ([`workload`]), and `memtide probe` ([`probe`], over the O_DIRECT runners in [`device`]).
//! Shared with the subcommands: SVG charts ([`plot`]) and report helpers ([`report`]). Flag
//! parsers, the checks before a launch and the run summary are the launch layer's
//! (`memtide-launch`), which this crate uses and which never uses it.

pub mod bench;
pub mod demo;
pub mod device;
pub mod kv;
pub mod lab;
pub mod micro;
pub mod plot;
pub mod probe;
pub mod quotas;
pub mod report;
pub mod system;
pub mod tenants;
pub mod vms;
pub mod workload;

// The launch layer's pieces, under the names the laboratory's modules use.
use memtide_launch::{opts, preflight, summary};
