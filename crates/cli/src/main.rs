//! The `memtide` binary: parses the command line and calls into the subcommands. Thin by design
//! and without `unsafe`: `run.rs` starts a program with tiered memory (memtide's main job, over
//! the engine's `launch` module), `host.rs` and `top.rs` the host daemon and its views (over
//! `memtide-host`), `sim.rs` and `plan.rs` are the simulator's and planner's commands (over
//! `memtide-sim`); demo, bench, probe and the built-in workload are the
//! laboratory in `memtide-bench`. Entry point: [`main`].
#![forbid(unsafe_code)]

mod host;
mod plan;
mod run;
mod sim;
mod top;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use memtide_bench::{bench, demo, probe, workload};

/// memtide: run programs with more memory than DRAM. Hot pages stay in DRAM, cold pages move to
/// a tier-1 file on an SSD/NVMe, without changing the program.
#[derive(Parser)]
#[command(name = "memtide", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run a program with its large anonymous memory tiered: at most --dram of it stays in DRAM,
    /// the rest lives in a tier-1 file.
    ///
    /// Example: memtide run --dram 1GiB --tier /var/tmp -- python3 big.py
    Run(run::RunArgs),
    /// Show tiering on a built-in workload: the same skewed random reads and writes over a
    /// footprint several times the DRAM budget, first all in DRAM, then under memtide.
    Demo(demo::DemoArgs),
    /// Measure memtide against all-DRAM and against Linux swap with the same DRAM budget, side
    /// by side, on the built-in workload (needs root for the Linux-swap configurations).
    Bench(bench::BenchArgs),
    /// Replay a synthetic access profile or a trace under other DRAM sizes and policies
    /// (memtide's own, LRU, CLOCK, ARC, 2Q, S3-FIFO, SIEVE, LFU, and Belady's optimum) and
    /// estimate the slowdown.
    ///
    /// Example: memtide sim --workload zipf:footprint=64GiB,skew=0.99,accesses=200M --dram 25%,50% --policy all
    Sim(sim::SimArgs),
    /// Plan hosts: from tenants' profiles (TOML), a loss budget and the prices of DRAM and tier,
    /// how many tenants fit per host, at which DRAM:tier split, what limits the packing, and
    /// the saving against all-DRAM.
    ///
    /// Example: memtide plan --tenants tenants.toml --dram-cost 3.0/GiB --tier-cost 0.1/GiB --max-loss 5%
    Plan(plan::PlanArgs),
    /// Judge a device as a memory tier: random read latency and IOPS, write IOPS, sequential
    /// bandwidth on an O_DIRECT test file under PATH, with a verdict by the operator guidance.
    ///
    /// Example: memtide probe /var/tmp --json probe.json
    Probe(probe::ProbeArgs),
    /// Share this host's DRAM among tenants by activeness: programs started with `memtide run
    /// --host` register here, each guaranteed its --dram, the rest following what is active.
    /// Serves Prometheus metrics.
    ///
    /// Example: memtide host --dram 16GiB --tier /mnt/nvme --ratio 1:1
    Host(host::HostArgs),
    /// The host daemon's view, once: the host line and a row per tenant.
    Status(host::StatusArgs),
    /// The host daemon's view, live in the terminal: sortable, refreshed every second.
    Top(top::TopArgs),
    /// The built-in workload (used by demo and bench).
    #[command(hide = true)]
    Workload(workload::WorkloadArgs),
    /// Puts back what a bench changed if the bench dies without doing so (started by bench).
    #[command(hide = true)]
    BenchJanitor,
}

/// A mistake on the command line: one line that names it (clap's first line, without its
/// tips and usage block), exit status 2. Help and version go out as clap writes them.
fn usage_error(e: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    if matches!(
        e.kind(),
        ErrorKind::DisplayHelp
            | ErrorKind::DisplayVersion
            | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    ) {
        e.exit();
    }
    let text = e.render().to_string();
    // The message is the first paragraph (a list of missing arguments follows its line).
    let first = text
        .lines()
        .take_while(|l| !l.trim().is_empty())
        .map(str::trim)
        .collect::<Vec<_>>()
        .join(" ");
    use clap::error::{ContextKind, ContextValue};
    let suggested = [
        ContextKind::SuggestedArg,
        ContextKind::SuggestedSubcommand,
        ContextKind::SuggestedValue,
    ]
    .iter()
    .find_map(|&k| match e.get(k) {
        Some(ContextValue::String(s)) => Some(s.clone()),
        Some(ContextValue::Strings(v)) if !v.is_empty() => Some(v.join(", ")),
        _ => None,
    });
    let running = std::env::args().nth(1).as_deref() == Some("run");
    let hint = match (suggested, e.kind()) {
        (Some(s), _) => format!(" (did you mean {s}?)"),
        (None, ErrorKind::UnknownArgument) if running => {
            " (--help lists the options; memtide's go before the program)".to_string()
        }
        _ => " (see --help)".to_string(),
    };
    eprintln!(
        "memtide: {}{hint}",
        first
            .trim_start_matches("error: ")
            .trim_end_matches(['.', ':'])
    );
    ExitCode::from(2)
}

fn main() -> ExitCode {
    memtide_engine::launch::default_sigpipe();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage_error(e),
    };
    let result = match cli.cmd {
        Cmd::Run(a) => run::run(a),
        Cmd::Demo(a) => demo::demo(a),
        Cmd::Bench(a) => bench::bench(a),
        Cmd::Sim(a) => sim::sim(a),
        Cmd::Plan(a) => plan::plan(a),
        Cmd::Host(a) => host::host(a),
        Cmd::Status(a) => host::status(a),
        Cmd::Top(a) => top::top(a),
        Cmd::Probe(a) => probe::probe(a),
        Cmd::BenchJanitor => memtide_bench::system::janitor(),
        Cmd::Workload(a) => workload::main(a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("memtide: {e:#}");
            ExitCode::from(2)
        }
    }
}
