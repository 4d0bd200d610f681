//! Guest file messages to API messages and statuses.

use proto::guest::{
    file_change, file_error::Code as G, file_info, FileChange, FileError, FileInfo,
};
use proto::hostagent as pb;
use tonic::Status;

/// A guest FileInfo as the API reports it.
pub fn info_pb(i: FileInfo) -> pb::FileInfo {
    use pb::file_info::Kind as K;
    let kind = match file_info::Kind::try_from(i.kind) {
        Ok(file_info::Kind::File) => K::File,
        Ok(file_info::Kind::Directory) => K::Directory,
        Ok(file_info::Kind::Symlink) => K::Symlink,
        Ok(file_info::Kind::Other) => K::Other,
        _ => K::Unspecified,
    };
    pb::FileInfo {
        path: i.path,
        kind: kind as i32,
        size: i.size,
        permissions: i.permissions,
        modified_unix_ns: i.modified_unix_ns,
        link_target: i.link_target,
    }
}

/// A guest change as the API reports it.
pub fn change_pb(c: FileChange) -> pb::FileChange {
    use pb::file_change::Kind as K;
    let kind = match file_change::Kind::try_from(c.kind) {
        Ok(file_change::Kind::Created) => K::Created,
        Ok(file_change::Kind::Modified) => K::Modified,
        Ok(file_change::Kind::Removed) => K::Removed,
        Ok(file_change::Kind::Renamed) => K::Renamed,
        Ok(file_change::Kind::Overflow) => K::Overflow,
        _ => K::Unspecified,
    };
    pb::FileChange {
        kind: kind as i32,
        path: c.path,
        to: c.to,
        is_dir: c.is_dir,
    }
}

/// The status of a guest's file error; the message names the field.
pub fn guest_status(e: FileError) -> Status {
    let text = if e.field.is_empty() {
        e.message
    } else {
        format!("{}: {}", e.field, e.message)
    };
    match G::try_from(e.code) {
        Ok(G::InvalidArgument) => Status::invalid_argument(text),
        Ok(G::NotFound) => Status::not_found(text),
        Ok(G::AlreadyExists) => Status::already_exists(text),
        Ok(G::PermissionDenied) => Status::permission_denied(text),
        Ok(G::FailedPrecondition) => Status::failed_precondition(text),
        Ok(G::ResourceExhausted) => Status::resource_exhausted(text),
        _ => Status::internal(format!("guest-init: {text}")),
    }
}

/// The status of a failed file call.
pub fn call_status(e: crate::guest::FileCallError) -> Status {
    match e {
        crate::guest::FileCallError::Refused(e) => guest_status(e),
        crate::guest::FileCallError::Channel(e) => e.into(),
    }
}
