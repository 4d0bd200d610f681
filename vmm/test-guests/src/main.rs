//! Prints the path of a built test guest: `test-guests hello`.

use std::process::ExitCode;

fn main() -> ExitCode {
    let name = std::env::args().nth(1).unwrap_or_else(|| "hello".into());
    match test_guests::path(&name) {
        Some(p) => {
            println!("{}", p.display());
            ExitCode::SUCCESS
        }
        None => {
            eprintln!(
                "unknown test guest {name:?}; known: {}",
                test_guests::ALL.join(", ")
            );
            ExitCode::from(2)
        }
    }
}
