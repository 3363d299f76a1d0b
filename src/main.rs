//! The `seathold` binary: parse the command line, set up logging, run.

use std::process::ExitCode;

use seathold::config::{Cli, Command, DeleteShowOptions, Options};
use seathold::server::{self, StartError};

/// Many small, short-lived allocations per request (bodies, keys, JSON):
/// mimalloc serves them with less CPU than glibc's malloc.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse_recording_given();
    let result = match cli.command {
        Some(Command::Dev(dev)) => dev_command(dev).await,
        Some(Command::Doctor(doctor)) => return doctor_command(doctor.options).await,
        Some(Command::DeleteShow(delete)) => return delete_show_command(delete).await,
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
    server::run(opts, listener, server::shutdown_signal_then_force()).await
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

/// Prints one line per show on stdout; 1 when a show was refused or Redis
/// failed, 2 for settings `serve` would refuse or an invalid show id.
async fn delete_show_command(delete: DeleteShowOptions) -> ExitCode {
    let mut opts = delete.options;
    if let Err(err) = seathold::logging::init(opts.log_format, &opts.log) {
        return config_error(err.into());
    }
    opts.settle();
    // The settings and the Redis options (seeds, URLs, credentials, TLS
    // files) as serve checks them: exit 2, not the 1 of a refused show.
    if let Err(err) = server::check(&opts) {
        return config_error(err);
    }
    let redis = match opts.redis() {
        Ok(redis) => redis,
        Err(err) => return config_error(err.into()),
    };
    let mut shows = Vec::with_capacity(delete.shows.len());
    for raw in &delete.shows {
        match seathold::ids::ShowId::parse(raw) {
            Ok(show) => shows.push(show),
            Err(_) => {
                eprintln!(
                    "seathold: {raw:?} is not a show id (1-64 characters from [A-Za-z0-9_.-])"
                );
                return ExitCode::from(2);
            }
        }
    }
    let keys = seathold::keys::KeySpace::new(opts.key_prefix.clone());
    let deleter = match seathold::delete_show::Deleter::connect(&redis, keys).await {
        Ok(deleter) => deleter,
        Err(why) => {
            eprintln!("seathold: {why}");
            return ExitCode::FAILURE;
        }
    };
    let mut code = ExitCode::SUCCESS;
    for show in &shows {
        match deleter.delete(show, delete.force, delete.dry_run).await {
            Ok(outcome) => {
                println!("{outcome}");
                if outcome.verdict.fails() {
                    code = ExitCode::FAILURE;
                }
            }
            Err(why) => {
                eprintln!("seathold: show {show}: {why}");
                return ExitCode::FAILURE;
            }
        }
    }
    code
}
