//! The `seathold` binary: parse the command line, set up logging, run.

use std::process::ExitCode;

use clap::Parser;
use seathold::config::{Cli, Command};
use seathold::server;

/// Many small, short-lived allocations per request (bodies, keys, JSON):
/// mimalloc serves them with less CPU than glibc's malloc.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Some(Command::Dev(dev)) => {
            seathold::init_tracing(dev.options.log_format, &dev.options.log);
            server::dev(dev, server::shutdown_signal()).await
        }
        Some(Command::Serve(opts)) => serve(opts).await,
        None => serve(cli.serve).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("seathold: {err}");
            ExitCode::from(2)
        }
    }
}

async fn serve(opts: seathold::config::Options) -> Result<(), server::StartError> {
    seathold::init_tracing(opts.log_format, &opts.log);
    opts.validate()?;
    let listener = server::bind(&opts).await?;
    server::run(opts, listener, server::shutdown_signal()).await
}
