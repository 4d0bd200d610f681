//! A compact seccomp BPF compiler for the vmm's allow lists.
//!
//! Written here rather than taken from seccompiler (which the tests keep as
//! the reference): the kernel converts and JITs a filter when a thread
//! installs it, at about 0.45 µs per instruction on this development
//! machine, and every vmm thread installs one on the way to the guest's first
//! instruction. seccompiler spends five instructions on each allowed system
//! call and on each allowed argument value (a compare, two jumps and a pair
//! of returns); this compiler spends one, jumping to returns shared by a
//! leaf of its search (below), so a thread kind's program is about a third
//! of the size (main: 192 instructions against 602). The verdicts are the
//! same: the tests run both
//! programs through a BPF interpreter over every system call number and the
//! argument values around each allowed one.
//!
//! Layout: the architecture check, then a binary search over the sorted
//! system call numbers (a JGE per inner node) down to leaves of at most
//! [`LEAF`] calls, each leaf a compare per call followed by its own pair of
//! returns and the argument blocks of its checked calls. The search is for
//! the kernel's sake more than the filter's: when a filter is installed,
//! the kernel emulates it once for every system call number of both x86
//! ABIs to find the calls it may allow without running it (the seccomp
//! action cache), and with one long compare chain that walk was most of the
//! install time. A search walks a few instructions per number instead: the
//! main thread's filter step in perf cold-boot's breakdown went from
//! 131-141 µs to 72-75 µs, and a cold boot's VMM CPU time by about 0.2 ms.

use std::collections::BTreeMap;

use seccompiler::sock_filter;

/// What a listed system call may be called with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ArgCheck {
    /// Any arguments.
    Any,
    /// Argument `arg` equals one of `values`: `qword` compares all 64 bits,
    /// otherwise the low 32 (the kernel's `int` and `unsigned int` arguments).
    OneOf {
        /// Argument index, 0 to 5.
        arg: u8,
        /// Whether the high 32 bits are compared too.
        qword: bool,
        /// The allowed values.
        values: Vec<u64>,
    },
    /// Argument `arg` (all 64 bits) has none of the bits of `mask`.
    Lacks {
        /// Argument index, 0 to 5.
        arg: u8,
        /// The forbidden bits.
        mask: u64,
    },
}

/// The allow list of a filter: system call number -> its argument check.
pub type AllowList = BTreeMap<i64, ArgCheck>;

/// `AUDIT_ARCH_X86_64`: the only architecture the filters accept.
pub const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
/// `SECCOMP_RET_KILL_PROCESS`: what a call from another architecture gets.
pub const RET_KILL_PROCESS: u32 = 0x8000_0000;
/// `SECCOMP_RET_TRAP`: SIGSYS.
pub const RET_TRAP: u32 = 0x0003_0000;
/// `SECCOMP_RET_ERRNO`, to be or-ed with the error number.
pub const RET_ERRNO: u32 = 0x0005_0000;
/// `SECCOMP_RET_ALLOW`.
pub const RET_ALLOW: u32 = 0x7fff_0000;

const LD_W_ABS: u16 = 0x20;
const JMP_JA: u16 = 0x05;
const JMP_JEQ_K: u16 = 0x15;
const JMP_JGE_K: u16 = 0x35;
const ALU_AND_K: u16 = 0x54;
const RET_K: u16 = 0x06;

/// Offsets in `struct seccomp_data`.
const NR_OFFSET: u32 = 0;
const ARCH_OFFSET: u32 = 4;
const ARGS_OFFSET: u32 = 16;

/// The longest conditional jump a classic BPF instruction can encode.
const MAX_JUMP: usize = u8::MAX as usize;
/// The most calls a leaf of the search compares in a chain.
const LEAF: usize = 16;

/// Why a list cannot be compiled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CompileError {
    /// More values in one argument check than a conditional jump reaches over.
    TooLong {
        /// What the chain is.
        what: String,
        /// How many entries it has.
        entries: usize,
    },
    /// A system call number outside 0..2^32 or an argument index above 5.
    Invalid(String),
}

impl std::fmt::Display for CompileError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CompileError::TooLong { what, entries } => write!(
                f,
                "{what} has {entries} entries; one compare chain holds at most {}",
                MAX_JUMP - 1
            ),
            CompileError::Invalid(m) => f.write_str(m),
        }
    }
}

fn stmt(code: u16, k: u32) -> sock_filter {
    sock_filter {
        code,
        jt: 0,
        jf: 0,
        k,
    }
}

fn jeq(k: u32, jt: usize, jf: usize) -> sock_filter {
    // Callers bound both offsets by MAX_JUMP (checked chain lengths).
    sock_filter {
        code: JMP_JEQ_K,
        jt: u8::try_from(jt).unwrap_or(u8::MAX),
        jf: u8::try_from(jf).unwrap_or(u8::MAX),
        k,
    }
}

fn arg_low(arg: u8) -> u32 {
    ARGS_OFFSET + 8 * u32::from(arg)
}

fn check_chain(what: impl FnOnce() -> String, entries: usize) -> Result<(), CompileError> {
    if entries >= MAX_JUMP {
        return Err(CompileError::TooLong {
            what: what(),
            entries,
        });
    }
    Ok(())
}

/// The block of one checked call: passes to `matched` or `mismatch`.
fn arg_block(
    nr: i64,
    check: &ArgCheck,
    matched: u32,
    mismatch: u32,
) -> Result<Vec<sock_filter>, CompileError> {
    let mut out = Vec::new();
    match check {
        ArgCheck::Any => out.push(stmt(RET_K, matched)),
        ArgCheck::OneOf {
            arg,
            qword: false,
            values,
        } => {
            check_chain(|| format!("the values of system call {nr}"), values.len())?;
            out.push(stmt(LD_W_ABS, arg_low(*arg)));
            let n = values.len();
            for (i, v) in values.iter().enumerate() {
                // To the shared `matched` return after the chain and the mismatch return.
                out.push(jeq(*v as u32, n - i, 0));
            }
            out.push(stmt(RET_K, mismatch));
            out.push(stmt(RET_K, matched));
        }
        ArgCheck::OneOf {
            arg,
            qword: true,
            values,
        } => {
            // Four instructions per value; the last value's high compare
            // jumps over the mismatch return, the others' over what follows.
            check_chain(
                || format!("the values of system call {nr}"),
                4 * values.len(),
            )?;
            let n = values.len();
            for (i, v) in values.iter().enumerate() {
                let after = 4 * (n - i - 1);
                out.push(stmt(LD_W_ABS, arg_low(*arg)));
                out.push(jeq(*v as u32, 0, 2));
                out.push(stmt(LD_W_ABS, arg_low(*arg) + 4));
                out.push(jeq((*v >> 32) as u32, after + 1, 0));
            }
            out.push(stmt(RET_K, mismatch));
            out.push(stmt(RET_K, matched));
        }
        ArgCheck::Lacks { arg, mask } => {
            out.push(stmt(LD_W_ABS, arg_low(*arg)));
            out.push(stmt(ALU_AND_K, *mask as u32));
            out.push(jeq(0, 0, 3));
            out.push(stmt(LD_W_ABS, arg_low(*arg) + 4));
            out.push(stmt(ALU_AND_K, (*mask >> 32) as u32));
            out.push(jeq(0, 1, 0));
            out.push(stmt(RET_K, mismatch));
            out.push(stmt(RET_K, matched));
        }
    }
    Ok(out)
}

/// Compiles `list` for x86_64: a listed call whose arguments pass its check
/// returns `matched`, any other call `mismatch`, a call made with another
/// architecture's convention kills the process.
pub fn compile(
    list: &AllowList,
    matched: u32,
    mismatch: u32,
) -> Result<Vec<sock_filter>, CompileError> {
    for (nr, check) in list {
        u32::try_from(*nr).map_err(|_| {
            CompileError::Invalid(format!("system call number {nr} is out of range"))
        })?;
        if let ArgCheck::OneOf { arg, .. } | ArgCheck::Lacks { arg, .. } = check {
            if *arg > 5 {
                return Err(CompileError::Invalid(format!(
                    "system call {nr}: argument {arg} does not exist (0 to 5)"
                )));
            }
        }
    }
    let entries: Vec<(u32, &ArgCheck)> = list.iter().map(|(nr, c)| (*nr as u32, c)).collect();
    let mut out = vec![
        stmt(LD_W_ABS, ARCH_OFFSET),
        jeq(AUDIT_ARCH_X86_64, 1, 0),
        stmt(RET_K, RET_KILL_PROCESS),
        stmt(LD_W_ABS, NR_OFFSET),
    ];
    out.extend(search(&entries, matched, mismatch)?);
    Ok(out)
}

/// The binary search over `entries` (sorted by number, the accumulator
/// holding the call's number): a JGE on the middle number, the lower half,
/// then the upper half.
fn search(
    entries: &[(u32, &ArgCheck)],
    matched: u32,
    mismatch: u32,
) -> Result<Vec<sock_filter>, CompileError> {
    if entries.len() <= LEAF {
        return leaf(entries, matched, mismatch);
    }
    let (lower, upper) = entries.split_at(entries.len() / 2);
    let pivot = upper[0].0;
    let lower = search(lower, matched, mismatch)?;
    let upper = search(upper, matched, mismatch)?;
    let mut out = Vec::with_capacity(2 + lower.len() + upper.len());
    match u8::try_from(lower.len()) {
        // At or above the pivot: over the lower half.
        Ok(over) => out.push(sock_filter {
            code: JMP_JGE_K,
            jt: over,
            jf: 0,
            k: pivot,
        }),
        // Too far for a conditional jump: through an unconditional one.
        Err(_) => {
            out.push(sock_filter {
                code: JMP_JGE_K,
                jt: 0,
                jf: 1,
                k: pivot,
            });
            out.push(stmt(JMP_JA, lower.len() as u32));
        }
    }
    out.extend(lower);
    out.extend(upper);
    Ok(out)
}

/// A leaf of the search: the checked calls (a compare and a jump to their
/// block each), the plain calls (a compare each), the two returns, then the
/// checked calls' argument blocks.
fn leaf(
    entries: &[(u32, &ArgCheck)],
    matched: u32,
    mismatch: u32,
) -> Result<Vec<sock_filter>, CompileError> {
    let (checked, plain): (Vec<_>, Vec<_>) =
        entries.iter().partition(|(_, c)| **c != ArgCheck::Any);
    let mut out = Vec::new();
    // The jumps' targets are patched once the blocks' places are known.
    let mut patches = Vec::with_capacity(checked.len());
    for (nr, _) in &checked {
        out.push(jeq(*nr, 0, 1));
        patches.push(out.len());
        out.push(stmt(JMP_JA, 0));
    }
    let n = plain.len();
    for (i, (nr, _)) in plain.iter().enumerate() {
        // Over the rest of the chain and the mismatch return (n <= LEAF).
        out.push(jeq(*nr, n - i, 0));
    }
    out.push(stmt(RET_K, mismatch));
    out.push(stmt(RET_K, matched));
    for ((nr, check), at) in checked.iter().zip(patches) {
        out[at].k = (out.len() - at - 1) as u32;
        out.extend(arg_block(i64::from(*nr), check, matched, mismatch)?);
    }
    Ok(out)
}

#[cfg(test)]
pub(crate) mod interpreter {
    //! A classic BPF interpreter for the instructions seccomp filters use,
    //! to compare what two programs answer.

    use super::*;

    /// The `struct seccomp_data` a filter sees.
    #[derive(Debug, Clone, Copy)]
    pub struct Data {
        pub nr: u32,
        pub arch: u32,
        pub args: [u64; 6],
    }

    impl Data {
        fn word(&self, offset: u32) -> u32 {
            match offset {
                0 => self.nr,
                4 => self.arch,
                o if (16..64).contains(&o) && o % 4 == 0 => {
                    let arg = self.args[((o - 16) / 8) as usize];
                    if (o - 16) % 8 == 0 {
                        arg as u32
                    } else {
                        (arg >> 32) as u32
                    }
                }
                o => panic!("load from offset {o}"),
            }
        }
    }

    /// What `program` returns for `data`; panics on anything malformed.
    pub fn run(program: &[sock_filter], data: &Data) -> u32 {
        execute(program, data).0
    }

    /// How many instructions `program` executes for `data`, its return included.
    pub fn steps(program: &[sock_filter], data: &Data) -> usize {
        execute(program, data).1
    }

    fn execute(program: &[sock_filter], data: &Data) -> (u32, usize) {
        let (mut pc, mut acc, mut steps) = (0usize, 0u32, 0usize);
        loop {
            let i = &program[pc];
            pc += 1;
            steps += 1;
            match i.code {
                LD_W_ABS => acc = data.word(i.k),
                ALU_AND_K => acc &= i.k,
                JMP_JA => pc += i.k as usize,
                JMP_JEQ_K => pc += usize::from(if acc == i.k { i.jt } else { i.jf }),
                JMP_JGE_K => pc += usize::from(if acc >= i.k { i.jt } else { i.jf }),
                RET_K => return (i.k, steps),
                code => panic!("instruction {code:#x} at {}", pc - 1),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::interpreter::{run, steps, Data};
    use super::*;

    fn data(nr: u32, args: [u64; 6]) -> Data {
        Data {
            nr,
            arch: AUDIT_ARCH_X86_64,
            args,
        }
    }

    fn list() -> AllowList {
        BTreeMap::from([
            (0, ArgCheck::Any),
            (3, ArgCheck::Any),
            (
                16,
                ArgCheck::OneOf {
                    arg: 1,
                    qword: false,
                    values: vec![0xae80, 0x4138_ae84],
                },
            ),
            (
                56,
                ArgCheck::OneOf {
                    arg: 0,
                    qword: true,
                    values: vec![0x3d0f00, 0x1_0000_0001],
                },
            ),
            (9, ArgCheck::Lacks { arg: 2, mask: 4 }),
        ])
    }

    #[test]
    fn each_kind_of_check_allows_exactly_its_values() {
        let p = compile(&list(), RET_ALLOW, RET_TRAP).unwrap();
        let allowed = |nr, args| run(&p, &data(nr, args)) == RET_ALLOW;
        assert!(allowed(0, [7; 6]));
        assert!(allowed(3, [0; 6]));
        assert!(!allowed(1, [0; 6]));
        assert!(!allowed(400, [0; 6]));
        // Low 32 bits only.
        assert!(allowed(16, [0, 0xae80, 0, 0, 0, 0]));
        assert!(allowed(16, [0, 0xffff_ffff_4138_ae84, 0, 0, 0, 0]));
        assert!(!allowed(16, [0, 0xae81, 0, 0, 0, 0]));
        assert!(!allowed(16, [0xae80, 0, 0, 0, 0, 0]));
        // All 64 bits.
        assert!(allowed(56, [0x3d0f00, 0, 0, 0, 0, 0]));
        assert!(allowed(56, [0x1_0000_0001, 0, 0, 0, 0, 0]));
        assert!(!allowed(56, [0x1_003d_0f00, 0, 0, 0, 0, 0]));
        assert!(!allowed(56, [0x1, 0, 0, 0, 0, 0]));
        assert!(!allowed(56, [0x2_0000_0001, 0, 0, 0, 0, 0]));
        // No bit of the mask, in either half.
        assert!(allowed(9, [0, 0, 3, 0, 0, 0]));
        assert!(!allowed(9, [0, 0, 7, 0, 0, 0]));
        let high = compile(
            &BTreeMap::from([(
                9,
                ArgCheck::Lacks {
                    arg: 2,
                    mask: 1 << 40,
                },
            )]),
            RET_ALLOW,
            RET_TRAP,
        )
        .unwrap();
        assert_eq!(run(&high, &data(9, [0, 0, 1 << 40, 0, 0, 0])), RET_TRAP);
        assert_eq!(run(&high, &data(9, [0, 0, 1, 0, 0, 0])), RET_ALLOW);
    }

    #[test]
    fn another_architecture_is_killed() {
        let p = compile(&list(), RET_ALLOW, RET_TRAP).unwrap();
        let mut d = data(0, [0; 6]);
        d.arch = 0x4000_0003; // i386
        assert_eq!(run(&p, &d), RET_KILL_PROCESS);
    }

    #[test]
    fn a_long_list_is_searched_in_a_few_steps_per_number() {
        let plain: AllowList = (0..300).map(|nr| (nr * 2, ArgCheck::Any)).collect();
        let p = compile(&plain, RET_ALLOW, RET_TRAP).unwrap();
        let mut longest = 0;
        for nr in 0..700u32 {
            let want = if nr % 2 == 0 && nr < 600 {
                RET_ALLOW
            } else {
                RET_TRAP
            };
            assert_eq!(run(&p, &data(nr, [0; 6])), want, "nr {nr}");
            longest = longest.max(steps(&p, &data(nr, [0; 6])));
        }
        // 300 calls: 5 levels of JGE over leaves of at most 16 compares,
        // after the arch check and the load (4) and before the return.
        assert!(longest <= 4 + 5 + LEAF + 1, "{longest} steps");
        // One compare per call, a JGE per inner node, two returns per leaf.
        let leaves = 32;
        assert_eq!(p.len(), 4 + 300 + (leaves - 1) + 2 * leaves);
    }

    #[test]
    fn a_lower_half_too_long_for_a_jump_is_jumped_over_unconditionally() {
        // Each call's value chain makes every leaf long: the top JGE cannot
        // reach over its lower half.
        let values: Vec<u64> = (0..200).collect();
        let heavy: AllowList = (0..40)
            .map(|nr| {
                (
                    nr,
                    ArgCheck::OneOf {
                        arg: 0,
                        qword: false,
                        values: values.clone(),
                    },
                )
            })
            .collect();
        let p = compile(&heavy, RET_ALLOW, RET_TRAP).unwrap();
        assert!(p
            .iter()
            .any(|i| i.code == JMP_JGE_K && i.jt == 0 && i.jf == 1));
        for nr in 0..45u32 {
            for v in [0u64, 199, 200] {
                let want = if nr < 40 && v < 200 {
                    RET_ALLOW
                } else {
                    RET_TRAP
                };
                assert_eq!(run(&p, &data(nr, [v, 0, 0, 0, 0, 0])), want, "{nr} {v}");
            }
        }
    }

    #[test]
    fn lists_too_long_for_a_jump_are_refused() {
        let values: Vec<u64> = (0..300).collect();
        let long = BTreeMap::from([(
            16,
            ArgCheck::OneOf {
                arg: 1,
                qword: false,
                values,
            },
        )]);
        assert!(matches!(
            compile(&long, RET_ALLOW, RET_TRAP),
            Err(CompileError::TooLong { entries: 300, .. })
        ));
        let bad_arg = BTreeMap::from([(1, ArgCheck::Lacks { arg: 6, mask: 1 })]);
        assert!(matches!(
            compile(&bad_arg, RET_ALLOW, RET_TRAP),
            Err(CompileError::Invalid(_))
        ));
        let bad_nr = BTreeMap::from([(-1, ArgCheck::Any)]);
        assert!(matches!(
            compile(&bad_nr, RET_ALLOW, RET_TRAP),
            Err(CompileError::Invalid(_))
        ));
    }
}
