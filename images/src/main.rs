//! `images`: builds the guest kernel, root filesystem and golden snapshot.
//! Each command prints the output directory on stdout (progress goes to
//! stderr), so scripts can use `$(images kernel)`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use images::{golden, kernel, rootfs};

#[derive(Parser)]
#[command(
    name = "images",
    version,
    about = "Guest image recipes: kernel, root filesystem, golden snapshot"
)]
struct Cli {
    /// Where outputs, downloads and unpacked sources are cached.
    #[arg(long, global = true, default_value = "target/images")]
    cache_dir: PathBuf,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Build the guest kernel (vmlinux) from Debian's linux-source.
    Kernel {
        /// Only configure and check the options (seconds), do not compile.
        #[arg(long)]
        check_config_only: bool,
        /// Debian source package.
        #[arg(long, default_value = kernel::DEFAULT_SOURCE_PACKAGE)]
        source_package: String,
        /// Exact package version (default: apt's candidate, recorded in the manifest).
        #[arg(long)]
        source_version: Option<String>,
        /// Config fragment (default: the checked-in images/kernel/microvm.config).
        #[arg(long)]
        config: Option<PathBuf>,
        /// make -j (default: the number of CPUs).
        #[arg(long)]
        jobs: Option<usize>,
    },
    /// Build the root filesystem image (rootfs.ext4); needs root.
    Rootfs {
        /// Image size in MiB.
        #[arg(long, default_value_t = rootfs::DEFAULT_SIZE_MIB)]
        size_mib: u64,
        /// A static guest-init (default: build one with cargo).
        #[arg(long)]
        guest_init: Option<PathBuf>,
        /// Cargo profile for building guest-init (`dev` compiles much faster, for tests).
        #[arg(long, value_enum, default_value = "release")]
        guest_init_profile: rootfs::guest_init::Profile,
        /// Debian suite.
        #[arg(long, default_value = "bookworm")]
        suite: String,
        /// Debian mirror (a snapshot.debian.org URL pins every package version).
        #[arg(long, default_value = "http://deb.debian.org/debian")]
        mirror: String,
    },
    /// Boot kernel + rootfs, wait for guest-init, pause and take a full snapshot.
    Golden {
        /// vmlinux.
        #[arg(long)]
        kernel: PathBuf,
        /// rootfs.ext4.
        #[arg(long)]
        rootfs: PathBuf,
        /// Output directory.
        #[arg(long)]
        out: PathBuf,
        /// vmm binary (default: beside this program, or in PATH).
        #[arg(long)]
        vmm: Option<PathBuf>,
        /// Guest memory in MiB.
        #[arg(long, default_value_t = 512)]
        mem_mib: u64,
        /// vCPUs.
        #[arg(long, default_value_t = 2)]
        vcpus: u64,
        /// Kernel command line.
        #[arg(long, default_value = golden::DEFAULT_CMDLINE)]
        cmdline: String,
        /// Seconds the boot may take until guest-init answers.
        #[arg(long, default_value_t = 120)]
        boot_timeout_s: u64,
        /// Give the guest a virtio-net device on this tap (`TAP[,mac=..]`).
        #[arg(long)]
        net: Option<String>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Cmd::Kernel {
            check_config_only,
            source_package,
            source_version,
            config,
            jobs,
        } => kernel::build(&kernel::KernelOptions {
            cache_dir: cli.cache_dir,
            source_package,
            source_version,
            fragment: config.unwrap_or_else(kernel::default_fragment),
            check_config_only,
            jobs: jobs
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())),
        }),
        Cmd::Rootfs {
            size_mib,
            guest_init,
            guest_init_profile,
            suite,
            mirror,
        } => rootfs::build(&rootfs::RootfsOptions {
            cache_dir: cli.cache_dir,
            size_mib,
            guest_init,
            guest_init_profile,
            base: rootfs::base::BaseOptions { suite, mirror },
        }),
        Cmd::Golden {
            kernel,
            rootfs,
            out,
            vmm,
            mem_mib,
            vcpus,
            cmdline,
            boot_timeout_s,
            net,
        } => golden::build(&golden::GoldenOptions {
            kernel,
            rootfs,
            out,
            vmm,
            mem_mib,
            vcpus,
            cmdline,
            boot_timeout: Duration::from_secs(boot_timeout_s),
            net,
        }),
    };
    match result {
        Ok(outcome) => {
            println!("{}", outcome.dir.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("images: {e}");
            ExitCode::from(1)
        }
    }
}
