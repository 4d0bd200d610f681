//! The `perf` command line: runs the scenarios and prints where the reports went.

use std::io::Write;
use std::process::ExitCode;

use clap::Parser;

use perf::cli::Cli;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match perf::run(cli) {
        Ok(outcome) => {
            // A closed stdout (`perf ... | head`) must not turn a finished run into a panic.
            let mut stdout = std::io::stdout().lock();
            let _ = write!(
                stdout,
                "{}",
                perf::report::markdown::render(&outcome.results)
            );
            for file in &outcome.files {
                let _ = writeln!(stdout, "wrote {}", file.display());
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
