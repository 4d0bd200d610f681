//! `real-guest`: end-to-end scenarios on real Linux guests under the
//! project's vmm, on any x86 host with QEMU, through nested virtualization:
//! QEMU in software emulation with an emulated AMD SVM CPU (the outer VM,
//! L1) gives a KVM that behaves like hardware, the vmm runs in it, and real
//! kernels boot under the vmm (L2). See tests/real-guest/README.md.
//!
//! `run` (on the host) prepares everything, runs each scenario group in a
//! fresh outer VM and prints one line per scenario and a summary; `inner`
//! is what runs inside the outer VM.

mod catalogue;
mod env;
mod inner;
mod outer;
mod prepare;
mod report;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "Real Linux guests end to end, through nested virtualization")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Prepare, boot an outer VM per group, run the scenarios, summarise.
    Run(RunArgs),
    /// List the groups and their scenarios.
    List,
    /// (Inside the outer VM.) Run one group's scenarios.
    Inner {
        /// The environment file `run` wrote.
        #[arg(long)]
        env: PathBuf,
        /// The group.
        #[arg(long)]
        group: String,
        /// Scenarios to leave out (comma-separated; finished in an earlier attempt).
        #[arg(long, default_value = "")]
        skip: String,
        /// Which of the group's attempts this is: each keeps its own logs, so
        /// a rerun does not overwrite what the failed attempt left.
        #[arg(long, default_value_t = 1)]
        attempt: u32,
    },
}

#[derive(clap::Args)]
struct RunArgs {
    /// Groups to run (default: all but the opt-in ones, such as soak, in
    /// order).
    #[arg(long = "group")]
    groups: Vec<String>,
    /// Scenarios to run (default: every scenario of the chosen groups); a
    /// group none of them belongs to is left out. Without --group, any
    /// group's scenarios may be named, opt-in ones included.
    #[arg(long = "scenario")]
    scenarios: Vec<String>,
    /// Iterations of each soak scenario (group soak); default: the
    /// environment variable RG_SOAK_N, else 50. The soak group's time limit
    /// scales with it.
    #[arg(long)]
    soak_n: Option<u32>,
    /// Outer-VM sessions per group before its remaining scenarios are given
    /// up as infrastructure failures.
    #[arg(long, default_value_t = 3)]
    attempts: u32,
    /// Cache of kernels, initramfs images and tools (default
    /// $XDG_CACHE_HOME/agentvm/real-guest or ~/.cache/agentvm/real-guest).
    #[arg(long)]
    cache: Option<PathBuf>,
    /// Work directory shared with the outer VM: logs, consoles, hang reports
    /// (default target/real-guest in the workspace; emptied first).
    #[arg(long)]
    work: Option<PathBuf>,
    /// Outer VM vCPUs.
    #[arg(long, default_value_t = 2)]
    l1_smp: u32,
    /// Outer VM memory, MiB.
    #[arg(long, default_value_t = 6144)]
    l1_mem_mib: u32,
    /// QEMU TCG thread mode: multi or single.
    #[arg(long, default_value = "multi")]
    tcg_thread: String,
    /// QEMU CPU model for the outer VM (it must offer SVM with nested paging).
    #[arg(long, default_value = "max")]
    l1_cpu: String,
    /// A kernel with its drivers built in for the node scenarios (the
    /// `images kernel` vmlinux); default: Debian's cloud kernel with an
    /// initramfs that loads its modules.
    #[arg(long)]
    node_kernel: Option<PathBuf>,
}

fn default_cache() -> PathBuf {
    if let Some(x) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(x).join("agentvm/real-guest");
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
    PathBuf::from(home).join(".cache/agentvm/real-guest")
}

fn run(args: RunArgs) -> Result<i32, String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err(
            "run as root: the outer VM shares / and chroots into it, and the \
                    root filesystem recipe runs debootstrap"
                .into(),
        );
    }
    let groups = choose_groups(&args.groups, &args.scenarios)?;
    // A bad count matters only to a run that soaks.
    let soak = match catalogue::SoakSettings::from_option_or_env(
        args.soak_n,
        std::env::var(catalogue::SOAK_N_ENV).ok().as_deref(),
    ) {
        Ok(soak) => soak,
        Err(e) if groups.iter().any(|g| g.name == catalogue::SOAK) => return Err(e),
        Err(_) => catalogue::SoakSettings::default(),
    };
    let groups: Vec<&catalogue::Group> = groups
        .into_iter()
        .map(|g| catalogue::sized(g, &soak))
        .collect();
    let root = prepare::workspace_root();
    let work = args.work.unwrap_or_else(|| root.join("target/real-guest"));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).map_err(|e| format!("{}: {e}", work.display()))?;
    let work = std::fs::canonicalize(&work).map_err(|e| format!("{}: {e}", work.display()))?;
    // The runner in the outer VM gets no environment: the count goes
    // through the work directory, beside env.json.
    soak.save(&work)?;
    let runner = std::env::current_exe().map_err(|e| format!("locating myself: {e}"))?;
    let bin_dir = runner
        .parent()
        .ok_or("the runner binary has no directory")?
        .to_path_buf();
    let cache = args.cache.unwrap_or_else(default_cache);
    std::fs::create_dir_all(&cache).map_err(|e| format!("{}: {e}", cache.display()))?;
    let mut keep = vec![root.clone(), bin_dir.clone(), cache.clone()];
    let crash_history = cache.join("crash-history.json");
    let prepared = prepare::prepare(&prepare::PrepareOptions {
        cache,
        bin_dir,
        work: work.clone(),
        node_image: groups.iter().any(|g| g.node_image),
        node_kernel: args.node_kernel,
    })
    .map_err(|e| format!("preparing the outer VM failed: {e}"))?;
    // virtiofsd's directory (its install may lie under a /tmp the outer VM
    // replaces).
    keep.extend(prepared.env.virtiofsd.parent().map(Path::to_path_buf));
    let keep = keep
        .into_iter()
        .map(|p| std::fs::canonicalize(&p).map_err(|e| format!("{}: {e}", p.display())))
        .collect::<Result<Vec<_>, _>>()?;
    prepared.env.save(&work.join("env.json"))?;
    let qemu = which("qemu-system-x86_64")
        .ok_or("qemu-system-x86_64 is missing: apt-get install qemu-system-x86")?;
    let opts = outer::RunOptions {
        l1: outer::qemu::L1Options {
            qemu,
            smp: args.l1_smp,
            mem_mib: args.l1_mem_mib,
            tcg_thread: args.tcg_thread,
            cpu: args.l1_cpu,
        },
        attempts: args.attempts.max(1),
        kernel: prepared.l1_kernel,
        initrd: prepared.l1_initrd,
        work,
        keep,
        runner,
        crash_history: Some(crash_history),
    };
    let summary = outer::run(&opts, &groups);
    Ok(outer::print_summary(&summary))
}

fn which(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(program))
        .find(|p| p.is_file())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let code = match cli.cmd {
        Cmd::Run(args) => match run(args) {
            Ok(code) => code,
            Err(e) => {
                eprintln!("real-guest: {e}");
                2
            }
        },
        Cmd::List => {
            for g in catalogue::GROUPS {
                let opt_in = if g.opt_in() {
                    " [opt-in: only when named with --group or --scenario]"
                } else {
                    ""
                };
                println!("{}: {}{opt_in}", g.name, g.about);
                for s in g.scenarios {
                    println!("  {s}");
                }
            }
            0
        }
        Cmd::Inner {
            env,
            group,
            skip,
            attempt,
        } => {
            let env = match env::InnerEnv::load(&env) {
                Ok(e) => e,
                Err(e) => {
                    eprintln!("real-guest inner: {e}");
                    return ExitCode::from(2);
                }
            };
            let Some(group) = catalogue::group(&group) else {
                eprintln!("real-guest inner: no group {group:?}");
                return ExitCode::from(2);
            };
            // The same limit as the outer half gave the group.
            let group = if group.name == catalogue::SOAK {
                match catalogue::SoakSettings::load(&env.work) {
                    Ok(soak) => catalogue::sized(group, &soak),
                    Err(e) => {
                        eprintln!("real-guest inner: {e}");
                        return ExitCode::from(2);
                    }
                }
            } else {
                group
            };
            let skip: Vec<String> = skip
                .split(',')
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect();
            inner::run(env, group, &skip, attempt)
        }
    };
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}

/// The groups `--group` names (`names`), cut down to the `--scenario`s
/// named (`scenarios`). Without either, every group but the opt-in ones;
/// with scenarios but no groups, whichever groups hold them, opt-in ones
/// included.
fn choose_groups(
    names: &[String],
    scenarios: &[String],
) -> Result<Vec<&'static catalogue::Group>, String> {
    let groups: Vec<&'static catalogue::Group> = if !names.is_empty() {
        names
            .iter()
            .map(|g| {
                catalogue::group(g).ok_or_else(|| {
                    format!(
                        "no group {g:?}; groups: {}",
                        catalogue::GROUPS
                            .iter()
                            .map(|g| g.name)
                            .collect::<Vec<_>>()
                            .join(", ")
                    )
                })
            })
            .collect::<Result<_, _>>()?
    } else if scenarios.is_empty() {
        catalogue::default_groups()
    } else {
        catalogue::GROUPS.iter().collect()
    };
    select_scenarios(groups, scenarios)
}

/// `groups` cut down to `wanted` scenarios (all of them when `wanted` is empty).
fn select_scenarios(
    groups: Vec<&'static catalogue::Group>,
    wanted: &[String],
) -> Result<Vec<&'static catalogue::Group>, String> {
    if wanted.is_empty() {
        return Ok(groups);
    }
    for w in wanted {
        if !groups.iter().any(|g| g.scenarios.contains(&w.as_str())) {
            return Err(format!(
                "no scenario {w:?} in the chosen groups (`real-guest list` names them)"
            ));
        }
    }
    Ok(groups
        .into_iter()
        .filter_map(|g| {
            let picked: Vec<&'static str> = g
                .scenarios
                .iter()
                .copied()
                .filter(|s| wanted.iter().any(|w| w == s))
                .collect();
            // Leaked once per run: the catalogue's groups are 'static.
            (!picked.is_empty()).then(|| {
                &*Box::leak(Box::new(catalogue::Group {
                    scenarios: Box::leak(picked.into_boxed_slice()),
                    ..*g
                }))
            })
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(groups: &[&catalogue::Group]) -> Vec<&'static str> {
        groups.iter().map(|g| g.name).collect()
    }

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_plain_run_takes_every_group_but_the_opt_in_ones() {
        let plain = choose_groups(&[], &[]).expect("plain");
        assert!(
            !names(&plain).contains(&catalogue::SOAK),
            "{:?}",
            names(&plain)
        );
        assert_eq!(
            plain.len(),
            catalogue::GROUPS.len() - catalogue::OPT_IN.len()
        );
    }

    #[test]
    fn an_opt_in_group_runs_when_named() {
        let soak = choose_groups(&strings(&["soak"]), &[]).expect("--group soak");
        assert_eq!(names(&soak), ["soak"]);
        assert_eq!(soak[0].scenarios, ["soak-smp-boots", "soak-smp-restores"]);
        let both = choose_groups(&strings(&["boot", "soak"]), &[]).expect("two groups");
        assert_eq!(names(&both), ["boot", "soak"]);
        // Its scenario named alone picks it, and nothing else.
        let one = choose_groups(&[], &strings(&["soak-smp-restores"])).expect("--scenario");
        assert_eq!(names(&one), ["soak"]);
        assert_eq!(one[0].scenarios, ["soak-smp-restores"]);
        let other = choose_groups(&[], &strings(&["boot-1-vcpu"])).expect("--scenario");
        assert_eq!(names(&other), ["boot"]);
        assert!(choose_groups(&strings(&["soaks"]), &[]).is_err());
        assert!(choose_groups(&strings(&["boot"]), &strings(&["soak-smp-boots"])).is_err());
    }
}
