//! Talking to the host daemon: one request, one answer, over its Unix socket. Entry point:
//! [`Client::connect`].

use std::io::{BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::protocol::{self, Request, Response};

/// Where the daemon listens unless told otherwise (`memtide host --socket`,
/// `MEMTIDE_HOST_SOCKET`).
pub fn default_socket() -> PathBuf {
    std::env::var_os("MEMTIDE_HOST_SOCKET")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/run/memtide/host.sock"))
}

pub struct Client {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Client {
    pub fn connect(path: &Path) -> Result<Client> {
        let s = UnixStream::connect(path).with_context(|| {
            format!(
                "cannot reach the memtide host daemon at {} (is `memtide host` running?)",
                path.display()
            )
        })?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        s.set_write_timeout(Some(Duration::from_secs(10)))?;
        Ok(Client {
            reader: BufReader::new(s.try_clone()?),
            writer: s,
        })
    }

    /// Sends `req` and waits for the answer; an error answer becomes an error.
    pub fn call(&mut self, req: &Request) -> Result<Response> {
        self.writer
            .write_all(protocol::encode(req).as_bytes())
            .context("the host daemon went away")?;
        let line = match protocol::read_line(&mut self.reader, protocol::MAX_ANSWER)? {
            Some(Ok(l)) => l,
            Some(Err(e)) => bail!("the host daemon's answer was unreadable: {e}"),
            None => bail!("the host daemon closed the connection"),
        };
        let resp: Response = serde_json::from_str(&line)
            .with_context(|| format!("the host daemon's answer was unreadable: {line}"))?;
        if let Response::Error { message } = resp {
            bail!("the host daemon refused: {message}");
        }
        Ok(resp)
    }
}
