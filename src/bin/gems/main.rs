//! The `gems` command line: clap's definitions in `cli`, one file per command (parse, one
//! library call, print).

mod bench;
mod cli;
mod data;
mod eval;
mod models;
mod plan;
mod predict;
mod train;

use std::process::ExitCode;

use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches};

use cli::{BenchCommand, Cli, Command, DataCommand, ScheduleCommand};

fn main() -> ExitCode {
    // Like other command-line tools, end quietly when the reader of our output goes away
    // (`gems models | head`) instead of failing a print.
    // SAFETY: setting a signal's disposition to the default at startup, before any threads.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    // Before any thread exists, so that every thread's allocations share one heap.
    gems::backend::cpu::tune_host_allocator();
    let matches = Cli::command().get_matches();
    let mut cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if let Some((_, m)) = matches.subcommand() {
        let given = given(m);
        match &mut cli.command {
            Command::Train(a) | Command::Plan(a) => a.given = given,
            Command::Simulate(a) => a.train.given = given,
            Command::Calibrate(a) => a.train.given = given,
            _ => {}
        }
    }
    if let Some(t) = cli.threads {
        if let Err(e) = rayon::ThreadPoolBuilder::new()
            .num_threads(t)
            .build_global()
        {
            eprintln!("error: cannot start {t} threads: {e}");
            return ExitCode::FAILURE;
        }
    }
    if let Some(path) = &cli.cpu_costs {
        if let Err(e) = gems::plan::fitted::use_cpu_fits(path) {
            eprintln!("error: {}", cli::explain(&e.into()));
            return ExitCode::FAILURE;
        }
    }
    let result = match cli.command {
        Command::Train(a) => train::train(*a),
        Command::Models(a) => models::list(a),
        Command::Eval(a) => eval::eval(a),
        Command::Predict(a) => predict::predict(a),
        Command::Export(a) => eval::export(a),
        Command::Plan(a) => plan::plan(*a),
        Command::Simulate(a) => plan::simulate(*a),
        Command::Calibrate(a) => plan::calibrate(*a),
        Command::FitCosts(a) => plan::fit_costs(a),
        Command::Data(DataCommand::MakeSlide(a)) => data::make_slide(a),
        Command::Data(DataCommand::Tiles(a)) => data::tiles(a),
        Command::Info => bench::info(),
        Command::Bench(BenchCommand::Kernels(a)) => bench::kernels(a),
        Command::Bench(BenchCommand::Offload(a)) => bench::offload(a),
        Command::Schedule(ScheduleCommand::Export(a)) => plan::export_schedule(*a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", cli::explain(&e));
            ExitCode::FAILURE
        }
    }
}

/// The ids of the flags given on the command line (not defaults).
fn given(m: &ArgMatches) -> Vec<String> {
    m.ids()
        .filter(|id| m.value_source(id.as_str()) == Some(ValueSource::CommandLine))
        .map(|id| id.to_string())
        .collect()
}
