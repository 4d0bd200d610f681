//! Paths inside the session workspace. Every path from the host is checked
//! here: it must be UTF-8, free of NUL, and stay inside the workspace after
//! `..` and symlinks are resolved.

use std::path::{Component, Path, PathBuf};

/// A path the host sent that cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PathError {
    /// Not valid UTF-8.
    #[error("path is not valid UTF-8 (bytes {0:?})")]
    NotUtf8(String),
    /// Contains a NUL byte.
    #[error("path {0:?} contains a NUL byte")]
    Nul(String),
    /// Leads outside the workspace.
    #[error("path {path:?} escapes the workspace {workspace}")]
    Escapes {
        /// The path as sent.
        path: String,
        /// The workspace root.
        workspace: String,
    },
    /// Does not exist or cannot be resolved.
    #[error("path {path:?} cannot be used as a directory in the workspace: {reason}")]
    Unusable {
        /// The path as sent.
        path: String,
        /// The OS error.
        reason: String,
    },
}

/// Resolves a working directory sent as raw bytes to an existing directory
/// inside `workspace` (empty means the workspace root).
pub fn resolve_dir(workspace: &Path, raw: &[u8]) -> Result<PathBuf, PathError> {
    let text = std::str::from_utf8(raw)
        .map_err(|_| PathError::NotUtf8(String::from_utf8_lossy(raw).into_owned()))?;
    if text.contains('\0') {
        return Err(PathError::Nul(text.replace('\0', "\\0")));
    }
    let escapes = || PathError::Escapes {
        path: text.to_string(),
        workspace: workspace.display().to_string(),
    };
    let root = workspace.canonicalize().map_err(|e| PathError::Unusable {
        path: workspace.display().to_string(),
        reason: e.to_string(),
    })?;
    let requested = Path::new(text);
    let relative = if requested.is_absolute() {
        requested
            .strip_prefix(workspace)
            .or_else(|_| requested.strip_prefix(&root))
            .map_err(|_| escapes())?
    } else {
        requested
    };
    // Lexical check first, so `..` never reaches the file system.
    let mut depth = 0usize;
    for c in relative.components() {
        match c {
            Component::Normal(_) => depth += 1,
            Component::CurDir => {}
            Component::ParentDir => depth = depth.checked_sub(1).ok_or_else(escapes)?,
            Component::RootDir | Component::Prefix(_) => return Err(escapes()),
        }
    }
    let full = root.join(relative);
    let resolved = full.canonicalize().map_err(|e| PathError::Unusable {
        path: text.to_string(),
        reason: e.to_string(),
    })?;
    if !resolved.starts_with(&root) {
        return Err(escapes());
    }
    if !resolved.is_dir() {
        return Err(PathError::Unusable {
            path: text.to_string(),
            reason: "not a directory".into(),
        });
    }
    Ok(resolved)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolves_and_refuses() {
        let dir = tempfile::tempdir().unwrap();
        let ws = dir.path();
        std::fs::create_dir(ws.join("sub")).unwrap();
        std::os::unix::fs::symlink("/etc", ws.join("link")).unwrap();
        let root = ws.canonicalize().unwrap();
        assert_eq!(resolve_dir(ws, b"").unwrap(), root);
        assert_eq!(resolve_dir(ws, b"sub").unwrap(), root.join("sub"));
        assert_eq!(resolve_dir(ws, b"sub/../sub/.").unwrap(), root.join("sub"));
        let abs = ws.join("sub");
        assert_eq!(
            resolve_dir(ws, abs.to_str().unwrap().as_bytes()).unwrap(),
            root.join("sub")
        );
        assert!(matches!(
            resolve_dir(ws, b"../"),
            Err(PathError::Escapes { .. })
        ));
        assert!(matches!(
            resolve_dir(ws, b"sub/../../x"),
            Err(PathError::Escapes { .. })
        ));
        assert!(matches!(
            resolve_dir(ws, b"/etc"),
            Err(PathError::Escapes { .. })
        ));
        assert!(matches!(
            resolve_dir(ws, b"link"),
            Err(PathError::Escapes { .. })
        ));
        assert!(matches!(
            resolve_dir(ws, b"\xff\xfe"),
            Err(PathError::NotUtf8(_))
        ));
        assert!(matches!(resolve_dir(ws, b"a\0b"), Err(PathError::Nul(_))));
        assert!(matches!(
            resolve_dir(ws, b"missing"),
            Err(PathError::Unusable { .. })
        ));
    }
}
