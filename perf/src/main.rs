//! The `perf` command line: runs the scenarios and prints where the reports went.

use std::process::ExitCode;

use clap::Parser;

use perf::cli::Cli;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match perf::run(cli) {
        Ok(outcome) => {
            print!("{}", perf::report::markdown::render(&outcome.results));
            for file in &outcome.files {
                println!("wrote {}", file.display());
            }
            if outcome.failed() {
                eprintln!("perf: some scenarios failed; see results.md");
                ExitCode::from(1)
            } else {
                ExitCode::SUCCESS
            }
        }
        Err(e) => {
            eprintln!("perf: {e}");
            ExitCode::from(2)
        }
    }
}
