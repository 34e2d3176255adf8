//! memtide's host view: the daemon that shares a host's DRAM among tenants by activeness
//! (`daemon.rs`), the line protocol tenants and admin clients speak to it (`protocol.rs`), a
//! client for it (`client.rs`), who may connect and how fast (`gate.rs`), what /proc says of a
//! tenant's processes (`procs.rs`), the last hour's samples (`history.rs`), and the Prometheus
//! metrics and the HTTP server with the dashboard (`metrics.rs`, `dashboard.html`).
//! The quota split itself is pure policy (`memtide_policy::share`). Entry points:
//! [`daemon::serve`], [`client::Client`], [`metrics::serve_http`].
#![forbid(unsafe_code)]

pub mod client;
pub mod daemon;
pub mod gate;
pub mod history;
pub mod metrics;
pub mod procs;
pub mod protocol;
