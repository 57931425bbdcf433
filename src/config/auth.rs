//! Where a node's pre-shared key comes from (SPEC.md §3.11).
//!
//! Authentication is on unless turned off explicitly. The key is read, first found wins,
//! from: a file named on the command line (`--psk-file`) or in the configuration file
//! (`[auth] psk_file`), the file named by `KVWIRE_PSK_FILE`, or the hex text of
//! `KVWIRE_PSK`. A key file holds the key as hex digits (at least 32, i.e. 16 bytes;
//! surrounding whitespace is ignored): `kvwire gen-psk > kvwire.psk` writes one.

use std::path::{Path, PathBuf};

use kvwire_proto::auth::{Psk, PskError};

use super::Auth;

/// Environment variable naming a key file.
pub const PSK_FILE_ENV: &str = "KVWIRE_PSK_FILE";
/// Environment variable holding the key itself, as hex.
pub const PSK_ENV: &str = "KVWIRE_PSK";

/// Where a key was found (never the key itself).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeySource {
    /// A file named on the command line or in the configuration file.
    File(PathBuf),
    /// The file named by `KVWIRE_PSK_FILE`.
    EnvFile(PathBuf),
    /// `KVWIRE_PSK`.
    Env,
}

impl std::fmt::Display for KeySource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::File(p) => write!(f, "file {}", p.display()),
            Self::EnvFile(p) => write!(f, "file {} (from {PSK_FILE_ENV})", p.display()),
            Self::Env => write!(f, "{PSK_ENV}"),
        }
    }
}

/// Why no usable key was found.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AuthConfigError {
    /// A key file could not be read.
    #[error("reading the pre-shared key file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The error.
        source: std::io::Error,
    },
    /// A key is malformed.
    #[error("pre-shared key from {from}: {error}")]
    Invalid {
        /// Where it came from.
        from: KeySource,
        /// What is wrong.
        error: PskError,
    },
    /// Authentication is on and no key was given.
    #[error("authentication is on but no pre-shared key was given: use --psk-file FILE, [auth] psk_file, {PSK_FILE_ENV} or {PSK_ENV} (hex), or turn authentication off explicitly (--insecure-no-auth, [auth] mode = \"off\")")]
    Missing,
}

/// Reads a key file (hex text).
pub fn psk_from_file(path: &Path, from: KeySource) -> Result<Psk, AuthConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| AuthConfigError::Read {
        path: path.display().to_string(),
        source,
    })?;
    Psk::from_hex(&text).map_err(|error| AuthConfigError::Invalid { from, error })
}

/// The key from `file` if given, else from the environment; `None` if there is none.
pub fn find_psk(file: Option<&Path>) -> Result<Option<(Psk, KeySource)>, AuthConfigError> {
    if let Some(p) = file {
        let from = KeySource::File(p.to_path_buf());
        return psk_from_file(p, from.clone()).map(|k| Some((k, from)));
    }
    if let Some(p) = std::env::var_os(PSK_FILE_ENV).filter(|v| !v.is_empty()) {
        let p = PathBuf::from(p);
        let from = KeySource::EnvFile(p.clone());
        return psk_from_file(&p, from.clone()).map(|k| Some((k, from)));
    }
    if let Some(v) = std::env::var_os(PSK_ENV).filter(|v| !v.is_empty()) {
        let text = v.to_string_lossy();
        return Psk::from_hex(&text)
            .map(|k| Some((k, KeySource::Env)))
            .map_err(|error| AuthConfigError::Invalid {
                from: KeySource::Env,
                error,
            });
    }
    Ok(None)
}

/// The node's authentication: off only when `off` is set; otherwise the key found by
/// [`find_psk`], or [`AuthConfigError::Missing`].
pub fn resolve(
    off: bool,
    file: Option<&Path>,
) -> Result<(Auth, Option<KeySource>), AuthConfigError> {
    if off {
        return Ok((Auth::Off, None));
    }
    match find_psk(file)? {
        Some((k, from)) => Ok((Auth::Psk(k), Some(from))),
        None => Err(AuthConfigError::Missing),
    }
}

/// A fresh random 32-byte key, from the operating system's random source.
pub fn generate_key() -> std::io::Result<[u8; 32]> {
    super::random_bytes()
}

/// A fresh random key as hex text (what `kvwire gen-psk` prints).
pub fn generate_hex() -> std::io::Result<String> {
    Ok(generate_key()?.iter().map(|b| format!("{b:02x}")).collect())
}
