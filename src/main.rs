//! The `seathold` binary: parse the command line, set up logging, run.

use std::process::ExitCode;

use clap::Parser;
use seathold::config::{Cli, Command, Options};
use seathold::server::{self, StartError};

/// Many small, short-lived allocations per request (bodies, keys, JSON):
/// mimalloc serves them with less CPU than glibc's malloc.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Some(Command::Dev(dev)) => dev_command(dev).await,
        Some(Command::Doctor(doctor)) => return doctor_command(doctor.options).await,
        Some(Command::Serve(opts)) => serve(opts).await,
        None => serve(cli.serve).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // The port is taken or the address not (yet) there: the machine,
        // not the configuration, may change, so a supervisor may restart
        // (exit 2 tells it not to: cluster/seathold.service).
        Err(err) if machine_may_change(&err) => {
            eprintln!("seathold: {err}");
            ExitCode::FAILURE
        }
        Err(err) => config_error(err),
    }
}

/// Whether start-up failed on something the machine, not the settings, may
/// change by itself: the port taken (an old instance still stopping), the
/// address not there yet.
fn machine_may_change(err: &StartError) -> bool {
    matches!(err, StartError::Listen { source, .. } if matches!(
        source.kind(),
        std::io::ErrorKind::AddrInUse | std::io::ErrorKind::AddrNotAvailable
    ))
}

/// Exit code 2 and one line: the configuration stopped start-up.
fn config_error(err: StartError) -> ExitCode {
    eprintln!("seathold: {err}");
    ExitCode::from(2)
}

async fn serve(mut opts: Options) -> Result<(), StartError> {
    seathold::logging::init(opts.log_format, &opts.log)?;
    opts.settle();
    server::check(&opts)?;
    let listener = server::bind(&opts).await?;
    server::run(opts, listener, server::shutdown_signal()).await
}

async fn dev_command(dev: seathold::config::DevOptions) -> Result<(), StartError> {
    seathold::logging::init(dev.options.log_format, &dev.options.log)?;
    server::dev(dev, server::shutdown_signal()).await
}

/// Prints the report on stdout; 1 when a check failed, 2 for settings
/// that `serve` would refuse (the doctor checks what `serve` would run).
async fn doctor_command(mut opts: Options) -> ExitCode {
    if let Err(err) = seathold::logging::init(opts.log_format, &opts.log) {
        return config_error(err.into());
    }
    opts.settle();
    if let Err(err) = opts.validate() {
        return config_error(err.into());
    }
    match seathold::doctor::run(&opts).await {
        Ok(report) => {
            print!("{report}");
            if report.failed() {
                ExitCode::from(1)
            } else {
                ExitCode::SUCCESS
            }
        }
        Err(err) => config_error(err),
    }
}
