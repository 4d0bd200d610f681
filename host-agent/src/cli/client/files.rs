//! `host-agent files stat|ls|get|put|mkdir|rm|mv|watch SESSION PATH ...`:
//! the Files service from the command line. `get` writes to stdout or a
//! file, `put` reads stdin or a file.

use std::path::PathBuf;

use clap::{Subcommand, ValueEnum};
use proto::hostagent as pb;
use proto::hostagent::files_client::FilesClient;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::transport::Channel;

use super::{execution_id_or_current, status as st, Bearer};
use crate::cli::output::{print_all, print_streamed, Output, Record};

/// How `put` writes.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum ModeArg {
    /// A new file; fails if the path exists.
    Create,
    /// Create or replace.
    Truncate,
    /// Create or add to the end.
    Append,
}

/// The `files` subcommands. Paths are relative to the workspace root.
#[derive(Subcommand)]
pub enum FilesCmd {
    /// Describe a path (a link is not followed).
    Stat {
        /// Session id.
        session: String,
        /// Path in the workspace.
        path: String,
    },
    /// List a directory.
    Ls {
        /// Session id.
        session: String,
        /// Directory (default: the workspace root).
        #[arg(default_value = ".")]
        path: String,
        /// Levels to list (1: the directory's entries).
        #[arg(long, default_value_t = 1)]
        depth: u32,
    },
    /// Download a file to stdout or `--to`.
    Get {
        /// Session id.
        session: String,
        /// File in the workspace.
        path: String,
        /// Local file to write (default: stdout).
        #[arg(long)]
        to: Option<PathBuf>,
        /// First byte.
        #[arg(long, default_value_t = 0)]
        offset: u64,
        /// Most bytes (0: to the end).
        #[arg(long, default_value_t = 0)]
        length: u64,
    },
    /// Upload stdin or `--from` to a file.
    Put {
        /// Session id.
        session: String,
        /// File in the workspace.
        path: String,
        /// Local file to read (default: stdin).
        #[arg(long)]
        from: Option<PathBuf>,
        /// How to write.
        #[arg(long, value_enum, default_value = "truncate")]
        mode: ModeArg,
        /// Permission bits, octal (default 644).
        #[arg(long)]
        permissions: Option<String>,
    },
    /// Make a directory.
    Mkdir {
        /// Session id.
        session: String,
        /// Directory to make.
        path: String,
        /// Make missing parents too.
        #[arg(short, long)]
        parents: bool,
    },
    /// Remove a file, link or directory.
    Rm {
        /// Session id.
        session: String,
        /// Path to remove.
        path: String,
        /// Remove a directory with its contents.
        #[arg(short, long)]
        recursive: bool,
    },
    /// Rename (move) a path.
    Mv {
        /// Session id.
        session: String,
        /// Path to move.
        from: String,
        /// New path.
        to: String,
        /// Replace an existing `to`.
        #[arg(long)]
        overwrite: bool,
    },
    /// Print changes under a directory until interrupted.
    Watch {
        /// Session id.
        session: String,
        /// Directory (default: the workspace root).
        #[arg(default_value = ".")]
        path: String,
        /// Only the directory itself, not those below it.
        #[arg(long)]
        no_recursive: bool,
    },
}

impl Record for pb::FileInfo {
    fn headers() -> &'static [&'static str] {
        &["PATH", "KIND", "SIZE", "MODE", "MODIFIED_NS", "TARGET"]
    }
    fn cells(&self) -> Vec<String> {
        vec![
            self.path.clone(),
            kind_name(self.kind()),
            self.size.to_string(),
            format!("{:o}", self.permissions),
            self.modified_unix_ns.to_string(),
            self.link_target.clone(),
        ]
    }
    fn json(&self) -> Value {
        json!({
            "path": self.path,
            "kind": kind_name(self.kind()),
            "size": self.size,
            "permissions": format!("{:o}", self.permissions),
            "modified_unix_ns": self.modified_unix_ns,
            "link_target": self.link_target,
        })
    }
}

impl Record for pb::FileChange {
    fn headers() -> &'static [&'static str] {
        &["CHANGE", "PATH", "TO"]
    }
    fn cells(&self) -> Vec<String> {
        vec![change_name(self.kind()), self.path.clone(), self.to.clone()]
    }
    fn json(&self) -> Value {
        json!({"change": change_name(self.kind()), "path": self.path, "to": self.to, "is_dir": self.is_dir})
    }
}

fn kind_name(k: pb::file_info::Kind) -> String {
    k.as_str_name().trim_start_matches("KIND_").to_lowercase()
}

fn change_name(k: pb::file_change::Kind) -> String {
    k.as_str_name().trim_start_matches("KIND_").to_lowercase()
}

/// Runs a `files` subcommand.
pub async fn run(ch: Channel, bearer: Bearer, out: Output, cmd: FilesCmd) -> Result<(), String> {
    let mut cl = FilesClient::with_interceptor(ch.clone(), bearer.clone())
        .max_decoding_message_size(8 << 20);
    let session = match &cmd {
        FilesCmd::Stat { session, .. }
        | FilesCmd::Ls { session, .. }
        | FilesCmd::Get { session, .. }
        | FilesCmd::Put { session, .. }
        | FilesCmd::Mkdir { session, .. }
        | FilesCmd::Rm { session, .. }
        | FilesCmd::Mv { session, .. }
        | FilesCmd::Watch { session, .. } => session.clone(),
    };
    let eid = execution_id_or_current(&ch, &bearer, &session, None).await?;
    let (session_id, execution_id) = (session, eid);
    match cmd {
        FilesCmd::Stat { path, .. } => {
            let i = cl
                .stat(pb::StatFileRequest {
                    session_id,
                    execution_id,
                    path,
                })
                .await
                .map_err(st)?
                .into_inner();
            print_all(&[i], out);
        }
        FilesCmd::Ls { path, depth, .. } => {
            let mut s = cl
                .list(pb::ListFilesRequest {
                    session_id,
                    execution_id,
                    path,
                    depth,
                })
                .await
                .map_err(st)?
                .into_inner();
            let mut all = Vec::new();
            let mut truncated = false;
            while let Some(page) = s.message().await.map_err(st)? {
                all.extend(page.entries);
                truncated |= page.truncated;
            }
            print_all(&all, out);
            if truncated {
                eprintln!("(listing cut at 100000 entries)");
            }
        }
        FilesCmd::Get {
            path,
            to,
            offset,
            length,
            ..
        } => {
            let mut s = cl
                .read(pb::ReadFileRequest {
                    session_id,
                    execution_id,
                    path,
                    offset,
                    length,
                })
                .await
                .map_err(st)?
                .into_inner();
            let mut w: Box<dyn tokio::io::AsyncWrite + Unpin + Send> = match &to {
                Some(p) => Box::new(
                    tokio::fs::File::create(p)
                        .await
                        .map_err(|e| format!("creating {}: {e}", p.display()))?,
                ),
                None => Box::new(tokio::io::stdout()),
            };
            while let Some(m) = s.message().await.map_err(st)? {
                w.write_all(&m.data)
                    .await
                    .map_err(|e| format!("writing: {e}"))?;
            }
            w.flush().await.map_err(|e| format!("writing: {e}"))?;
        }
        FilesCmd::Put {
            path,
            from,
            mode,
            permissions,
            ..
        } => {
            let permissions = match permissions {
                Some(p) => u32::from_str_radix(&p, 8)
                    .map_err(|_| format!("--permissions {p:?} is not an octal number"))?,
                None => 0,
            };
            let mode = match mode {
                ModeArg::Create => pb::WriteMode::Create,
                ModeArg::Truncate => pb::WriteMode::Truncate,
                ModeArg::Append => pb::WriteMode::Append,
            };
            let mut r: Box<dyn tokio::io::AsyncRead + Unpin + Send> = match &from {
                Some(p) => Box::new(
                    tokio::fs::File::open(p)
                        .await
                        .map_err(|e| format!("opening {}: {e}", p.display()))?,
                ),
                None => Box::new(tokio::io::stdin()),
            };
            let (tx, rx) = tokio::sync::mpsc::channel(4);
            let start = pb::WriteFileRequest {
                kind: Some(pb::write_file_request::Kind::Start(pb::WriteFileStart {
                    session_id,
                    execution_id,
                    path,
                    mode: mode as i32,
                    permissions,
                })),
            };
            let _ = tx.send(start).await;
            let call = tokio::spawn(async move {
                cl.write(tokio_stream::wrappers::ReceiverStream::new(rx))
                    .await
            });
            let mut buf = vec![0u8; 1 << 20];
            loop {
                let n = r
                    .read(&mut buf)
                    .await
                    .map_err(|e| format!("reading: {e}"))?;
                if n == 0 {
                    break;
                }
                let m = pb::WriteFileRequest {
                    kind: Some(pb::write_file_request::Kind::Data(buf[..n].to_vec())),
                };
                if tx.send(m).await.is_err() {
                    // The call ended early; its status says why.
                    break;
                }
            }
            drop(tx);
            let done = call
                .await
                .map_err(|e| format!("upload task: {e}"))?
                .map_err(st)?
                .into_inner();
            eprintln!("wrote {} bytes", done.bytes_written);
            if let Some(i) = done.info {
                print_all(&[i], out);
            }
        }
        FilesCmd::Mkdir { path, parents, .. } => {
            let i = cl
                .make_dir(pb::MakeDirRequest {
                    session_id,
                    execution_id,
                    path,
                    parents,
                    permissions: 0,
                })
                .await
                .map_err(st)?
                .into_inner();
            print_all(&[i], out);
        }
        FilesCmd::Rm {
            path, recursive, ..
        } => {
            let r = cl
                .remove(pb::RemoveFileRequest {
                    session_id,
                    execution_id,
                    path,
                    recursive,
                })
                .await
                .map_err(st)?
                .into_inner();
            eprintln!("removed {} entries", r.removed);
        }
        FilesCmd::Mv {
            from,
            to,
            overwrite,
            ..
        } => {
            let i = cl
                .rename(pb::RenameFileRequest {
                    session_id,
                    execution_id,
                    from,
                    to,
                    overwrite,
                })
                .await
                .map_err(st)?
                .into_inner();
            print_all(&[i], out);
        }
        FilesCmd::Watch {
            path, no_recursive, ..
        } => {
            let mut s = cl
                .watch(pb::WatchFilesRequest {
                    session_id,
                    execution_id,
                    path,
                    recursive: !no_recursive,
                })
                .await
                .map_err(st)?
                .into_inner();
            let mut first = true;
            while let Some(c) = s.message().await.map_err(st)? {
                print_streamed(&c, first, out);
                first = false;
            }
        }
    }
    Ok(())
}
