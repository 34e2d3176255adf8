//! `memtide top`: the host daemon's view, live, in the terminal (ratatui): a host line and a
//! row per tenant, sortable, refreshed every interval. Keys: `s` next sort column, `r` reverse,
//! `q` or Esc to quit. Entry point: [`top`].

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use clap::Args;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind};
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Paragraph, Row, Table};
use ratatui::Frame;

use memtide_engine::size::format as bytes;
use memtide_host::client::default_socket;
use memtide_host::protocol::{HostStatus, TenantStatus};
use memtide_launch::opts;

use crate::host::{fetch_status, tenant_row, COLUMNS};

#[derive(Args, Debug)]
pub struct TopArgs {
    /// The host daemon's socket.
    #[arg(long, default_value_os_t = default_socket())]
    pub socket: PathBuf,
    /// How often to refresh.
    #[arg(long, value_parser = opts::seconds, default_value = "1s")]
    pub interval: f64,
}

/// A column's value for sorting.
type SortKey = fn(&TenantStatus) -> f64;

/// The columns one can sort by, in the order `s` cycles through them.
const SORTS: [(&str, SortKey); 6] = [
    ("quota", |t| t.quota_bytes as f64),
    ("DRAM", |t| t.report.dram_bytes as f64),
    ("active", |t| t.report.active_bytes as f64),
    ("active %", |t| t.active_pct),
    ("faults/s", |t| t.faults_per_second),
    ("tier", |t| t.report.tier_bytes as f64),
];

fn colour(health: &str) -> Color {
    match health {
        "red" => Color::Red,
        "yellow" => Color::Yellow,
        _ => Color::Green,
    }
}

struct View {
    status: Option<HostStatus>,
    error: Option<String>,
    sort: usize,
    reverse: bool,
}

fn draw(f: &mut Frame, v: &View) {
    let [head, body, foot] = Layout::vertical([
        Constraint::Length(3),
        Constraint::Min(3),
        Constraint::Length(1),
    ])
    .areas(f.area());
    let (sort_name, key) = SORTS[v.sort];
    let help = format!(
        " sorted by {sort_name}{} · s: sort · r: reverse · q: quit",
        if v.reverse { " (ascending)" } else { "" }
    );
    f.render_widget(
        Paragraph::new(help).style(Style::default().add_modifier(Modifier::DIM)),
        foot,
    );
    let Some(s) = &v.status else {
        let msg = v
            .error
            .clone()
            .unwrap_or_else(|| "waiting for the daemon…".into());
        f.render_widget(
            Paragraph::new(msg).block(Block::bordered().title(" memtide top ")),
            head,
        );
        return;
    };
    let host = vec![
        Line::from(vec![
            Span::raw(format!(
                "DRAM {} of {} budget (quotas {}) · tier {} of {} · up {:.0} s",
                bytes(s.dram_bytes),
                bytes(s.budget_bytes),
                bytes(s.quota_bytes),
                bytes(s.tier_bytes),
                bytes(s.tier_capacity_bytes),
                s.uptime_seconds
            )),
            Span::styled(
                v.error
                    .as_ref()
                    .map(|e| format!("  (stale: {e})"))
                    .unwrap_or_default(),
                Style::default().fg(Color::Red),
            ),
        ]),
        Line::from(vec![
            Span::raw(format!(
                "active {} ({:.0}% of the budget) ",
                bytes(s.active_bytes),
                s.active_bytes as f64 * 100.0 / s.budget_bytes.max(1) as f64
            )),
            Span::styled(
                s.active_health.clone(),
                Style::default()
                    .fg(colour(&s.active_health))
                    .add_modifier(Modifier::BOLD),
            ),
            Span::raw(format!(
                " · tier read p50 {:.0} µs, p99 {:.0} µs ",
                s.tier_read_latency_p50_us, s.tier_read_latency_p99_us
            )),
            Span::styled(
                s.latency_health.clone(),
                Style::default()
                    .fg(colour(&s.latency_health))
                    .add_modifier(Modifier::BOLD),
            ),
        ]),
    ];
    f.render_widget(
        Paragraph::new(host).block(Block::bordered().title(" memtide top: host ")),
        head,
    );
    let mut tenants: Vec<&TenantStatus> = s.tenants.iter().collect();
    tenants.sort_by(|a, b| key(b).total_cmp(&key(a)));
    if v.reverse {
        tenants.reverse();
    }
    let header = Row::new(COLUMNS).style(Style::default().add_modifier(Modifier::BOLD));
    let rows = tenants
        .iter()
        .map(|t| Row::new(tenant_row(t, usize::MAX)).style(Style::default().fg(colour(&t.health))));
    let widths = [
        Constraint::Length(4),
        Constraint::Min(12),
        Constraint::Length(8),
        Constraint::Length(11),
        Constraint::Length(11),
        Constraint::Length(11),
        Constraint::Length(11),
        Constraint::Length(11),
        Constraint::Length(11),
        Constraint::Length(11),
        Constraint::Length(5),
        Constraint::Length(7),
        Constraint::Length(9),
        Constraint::Length(8),
        Constraint::Length(8),
    ];
    let title = format!(" {} tenant(s) ", s.tenants.len());
    f.render_widget(
        Table::new(rows, widths)
            .header(header)
            .block(Block::bordered().title(title)),
        body,
    );
}

pub fn top(a: TopArgs) -> Result<ExitCode> {
    if !std::io::stdout().is_terminal() {
        bail!("memtide top needs a terminal; `memtide status` prints the same once");
    }
    // Fail before taking over the screen if there is no daemon at all.
    let first = fetch_status(&a.socket)?;
    let mut view = View {
        status: Some(first),
        error: None,
        sort: 0,
        reverse: false,
    };
    let interval = Duration::from_secs_f64(a.interval);
    let mut terminal = ratatui::init();
    let mut next = Instant::now() + interval;
    let result = loop {
        if let Err(e) = terminal.draw(|f| draw(f, &view)) {
            break Err(e.into());
        }
        let wait = next.saturating_duration_since(Instant::now());
        match event::poll(wait) {
            Ok(true) => {
                if let Ok(Event::Key(k)) = event::read() {
                    if k.kind == KeyEventKind::Press {
                        match k.code {
                            KeyCode::Char('q') | KeyCode::Esc => break Ok(()),
                            KeyCode::Char('s') => view.sort = (view.sort + 1) % SORTS.len(),
                            KeyCode::Char('r') => view.reverse = !view.reverse,
                            _ => {}
                        }
                    }
                }
                continue;
            }
            Ok(false) => {}
            Err(e) => break Err(e.into()),
        }
        next = Instant::now() + interval;
        match fetch_status(&a.socket) {
            Ok(s) => {
                view.status = Some(s);
                view.error = None;
            }
            Err(e) => view.error = Some(format!("{e:#}")),
        }
    };
    ratatui::restore();
    result.map(|()| ExitCode::SUCCESS)
}
