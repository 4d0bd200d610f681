use super::*;

fn run(argv: &[&str], env: &[(&str, &str)]) -> Vec<Subject> {
    let argv: Vec<String> = argv.iter().map(|s| s.to_string()).collect();
    let env: BTreeMap<String, String> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let ctx = ExecContext {
        workspace: Path::new("/workspace"),
        cwd: Path::new("/workspace/src"),
        env: &env,
    };
    subjects(&argv, &ctx).unwrap()
}

fn texts_of(argv: &[&str]) -> Vec<String> {
    run(argv, &[]).into_iter().map(|s| s.text).collect()
}

fn plain(argv: &[&str]) -> bool {
    run(argv, &[]).iter().all(|s| s.escalations.is_empty())
}

#[test]
fn programs_resolve_to_their_path() {
    assert_eq!(texts_of(&["/usr/bin/git", "push"]), ["git push"]);
    assert_eq!(
        texts_of(&["./git", "status"]),
        ["/workspace/src/git status"]
    );
    assert_eq!(texts_of(&["../bin/../x", "a"]), ["/workspace/x a"]);
    assert_eq!(texts_of(&["/usr/bin/sub/git"]), ["/usr/bin/sub/git"]);
    assert_eq!(texts_of(&["/usr/local/bin/../../../tmp/git"]), ["/tmp/git"]);
}

#[test]
fn wrappers_are_unwrapped() {
    assert_eq!(texts_of(&["env", "-i", "A=1", "git", "push"]), ["git push"]);
    assert_eq!(
        texts_of(&["timeout", "-s", "KILL", "10s", "git", "push"]),
        ["git push"]
    );
    assert_eq!(texts_of(&["nice", "-5", "git", "push"]), ["git push"]);
    assert_eq!(texts_of(&["stdbuf", "-oL", "-e", "0", "make"]), ["make"]);
    assert_eq!(texts_of(&["env"]), ["env"]);
    assert_eq!(texts_of(&["/usr/bin/env", "-i"]), ["env -i"]);
    assert_eq!(
        texts_of(&[
            "sudo",
            "env",
            "X=1",
            "timeout",
            "5",
            "nice",
            "/usr/bin/git",
            "push"
        ]),
        ["git push"]
    );
    assert_eq!(
        texts_of(&["find", ".", "-name", "x", "-exec", "rm", "{}", ";", "-print"]),
        ["rm {}", "find . -name x -exec rm {} ; -print"]
    );
    assert!(plain(&["timeout", "5", "nohup", "setsid", "git", "status"]));
    assert!(!plain(&["sudo", "git", "status"]));
    assert!(!plain(&["xargs", "git", "status"]));
}

#[test]
fn shell_scripts_are_split() {
    assert_eq!(
        texts_of(&[
            "bash",
            "-lc",
            "git status && sudo git push origin main; ls | wc -l"
        ]),
        ["git status", "git push origin main", "ls", "wc -l"]
    );
    assert_eq!(
        texts_of(&["sh", "-c", "echo 'a; b' \"c|d\""]),
        ["echo a; b c|d"]
    );
    assert_eq!(texts_of(&["sh", "-c", "make 2>&1 > out.log"]), ["make"]);
    assert_eq!(
        texts_of(&["env", "bash", "-c", "sh -c 'git push x'"]),
        ["git push x"]
    );
    assert_eq!(
        texts_of(&["sh", "-c", "echo $(git push)"]),
        ["git push", "echo $(git push)"]
    );
}

#[test]
fn variables_that_change_what_runs() {
    assert!(!plain(&["env", "PATH=/x", "ls"]));
    assert!(!plain(&["sh", "-c", "LD_PRELOAD=x ls"]));
    assert!(!plain(&["sh", "-c", "export GIT_DIR=x; ls"]));
    assert!(plain(&["env", "LANG=C", "ls"]));
    let s = run(&["ls"], &[("NODE_OPTIONS", "--require x")]);
    assert_eq!(
        s[0].escalations,
        ["the Exec's environment sets NODE_OPTIONS"]
    );
    assert_eq!(s[0].key(), "ls [the Exec's environment sets NODE_OPTIONS]");
}

#[test]
fn redirections() {
    assert!(plain(&["sh", "-c", "echo x > ../y 2>/dev/null"]));
    assert!(!plain(&["sh", "-c", "echo x > ../../y"]));
    assert!(!plain(&["sh", "-c", "echo x > /workspace/.git/config"]));
    assert!(!plain(&["sh", "-c", "> /etc/motd"]));
}

#[test]
fn errors() {
    let ctx_env = BTreeMap::new();
    let ctx = ExecContext {
        workspace: Path::new("/w"),
        cwd: Path::new("/w"),
        env: &ctx_env,
    };
    assert_eq!(subjects(&[], &ctx), Err(CommandError::Empty));
    let argv: Vec<String> = ["sh", "-c", "echo 'open"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(subjects(&argv, &ctx), Err(CommandError::UnterminatedQuote));
    let argv: Vec<String> = ["sh", "-c", "eval eval 'git push'"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let found: Vec<String> = subjects(&argv, &ctx)
        .unwrap()
        .into_iter()
        .map(|s| s.text)
        .collect();
    assert_eq!(found, ["git push"]);
    let mut script = String::from("true");
    for _ in 0..10 {
        script = format!("sh -c {}", shell_quote(&script));
    }
    let argv: Vec<String> = vec!["sh".into(), "-c".into(), script];
    assert_eq!(subjects(&argv, &ctx), Err(CommandError::TooDeep(MAX_DEPTH)));
}

/// Scripts from a fixed pseudo-random sequence over shell's special
/// characters: each is decided or refused with an error, never a panic;
/// large inputs (a frame holds 4 MiB) are read in one pass.
#[test]
fn any_script_is_decided_or_refused() {
    const ALPHABET: &[&str] = &[
        " ",
        "\n",
        ";",
        "&",
        "|",
        "(",
        ")",
        "{",
        "}",
        "<",
        ">",
        "'",
        "\"",
        "`",
        "$",
        "$(",
        "${",
        "\\",
        "#",
        "*",
        "?",
        "[",
        "]",
        "~",
        "=",
        "2>",
        "<<",
        "EOF",
        "git",
        "push",
        "sh -c ",
        "env ",
        "PATH=x ",
        "find . -exec ",
        "xargs ",
        "-c",
        "{}",
        ",",
        "..",
        "/",
    ];
    let env = BTreeMap::new();
    let ctx = ExecContext {
        workspace: Path::new("/w"),
        cwd: Path::new("/w"),
        env: &env,
    };
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let (mut ok, mut refused) = (0, 0);
    for _ in 0..20_000 {
        let mut script = String::new();
        for _ in 0..(state % 24) {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            script.push_str(ALPHABET[(state >> 33) as usize % ALPHABET.len()]);
        }
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        match subjects(&["sh".into(), "-c".into(), script], &ctx) {
            Ok(_) => ok += 1,
            Err(_) => refused += 1,
        }
    }
    assert!(ok > 1000 && refused > 1000, "ok {ok}, refused {refused}");
    for big in [
        "[".repeat(1 << 20),
        "A=1 ".repeat(1 << 18) + "ls",
        "echo ".to_string() + &"$x ".repeat(1 << 18),
        "echo ".to_string() + &">/tmp/x ".repeat(1 << 17),
        "{".repeat(1 << 20),
        "nohup ".repeat(400) + "echo " + &"x ".repeat(1 << 19),
    ] {
        let argv = vec!["sh".to_string(), "-c".to_string(), big];
        let s = subjects(&argv, &ctx).unwrap();
        assert!(s.iter().all(|s| s.escalations.len() <= MAX_REASONS + 1));
    }
    let many = vec!["ls".to_string(); 1 << 18].join(";");
    let argv = vec!["sh".to_string(), "-c".to_string(), many];
    assert_eq!(subjects(&argv, &ctx), Err(CommandError::TooLong(MAX_STEPS)));
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}
