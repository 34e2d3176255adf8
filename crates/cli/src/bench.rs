use clap::Args;
use std::process::ExitCode;
#[derive(Args, Debug)]
pub struct BenchArgs {}
pub fn bench(_a: BenchArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("unfinished")
}
