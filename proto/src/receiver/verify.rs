//! The receiver's checks: a COMMIT against its reservation, and the digests of the landed
//! memory (and of the aux record) against the COMMIT.

use super::state::Spec;
use crate::error::{CountField, FailureReason};
use crate::wire::{Commit, TransferDigests};

/// Checks a commit against the reservation; the first disagreement is the reason.
pub(super) fn check_commit(spec: &Spec, c: &Commit) -> Result<(), FailureReason> {
    let counts = [
        (
            CountField::Tokens,
            u64::from(spec.tokens),
            u64::from(c.tokens),
        ),
        (CountField::Pages, u64::from(spec.pages), u64::from(c.pages)),
        (CountField::Bytes, spec.bytes, c.bytes),
    ];
    for (field, expected, got) in counts {
        if expected != got {
            return Err(FailureReason::CountMismatch {
                field,
                expected,
                got,
            });
        }
    }
    if c.digest != spec.digest {
        return Err(FailureReason::ProtocolViolation {
            detail: format!(
                "commit digest {} differs from the reserved {}",
                c.digest, spec.digest
            ),
        });
    }
    if c.buffer_digests.len() != spec.buffers {
        return Err(FailureReason::MissingDigest {
            detail: format!(
                "{} buffer digests for {} buffers",
                c.buffer_digests.len(),
                spec.buffers
            ),
        });
    }
    if let Some(b) = c.buffer_digests.iter().position(|d| d.is_zero()) {
        return Err(FailureReason::MissingDigest {
            detail: format!("buffer {b} digest is all zero"),
        });
    }
    let want_pages = spec.buffers as u64 * u64::from(spec.pages);
    match (spec.page_digests, c.page_digests.len() as u64) {
        (true, n) if n != want_pages => Err(FailureReason::MissingDigest {
            detail: format!("{n} page digests, {want_pages} required"),
        }),
        (false, n) if n != 0 && n != want_pages => Err(FailureReason::ProtocolViolation {
            detail: format!("{n} page digests for {want_pages} pages"),
        }),
        _ => Ok(()),
    }?;
    if c.aux.len() > spec.max_aux as usize {
        return Err(FailureReason::AuxTooLarge {
            len: u32::try_from(c.aux.len()).unwrap_or(u32::MAX),
            max: spec.max_aux,
        });
    }
    if c.aux_digest.is_zero() {
        return Err(FailureReason::MissingDigest {
            detail: "aux digest is all zero".into(),
        });
    }
    Ok(())
}

/// Compares the landed memory's digests with the commit's; names the first bad buffer and,
/// where the commit has per-page digests, the first bad page in it.
pub(super) fn compare_digests(
    spec: &Spec,
    commit: &Commit,
    landed: &TransferDigests,
) -> Result<(), FailureReason> {
    let pages = spec.pages as usize;
    for b in 0..spec.buffers {
        let ours = landed.buffers.get(b);
        if ours != Some(&commit.buffer_digests[b]) {
            let page = if commit.page_digests.is_empty()
                || landed.pages.len() != commit.page_digests.len()
            {
                None
            } else {
                let range = b * pages..(b + 1) * pages;
                landed.pages[range.clone()]
                    .iter()
                    .zip(&commit.page_digests[range])
                    .position(|(x, y)| x != y)
                    .map(|p| p as u32)
            };
            return Err(FailureReason::DigestMismatch {
                buffer: b as u32,
                page,
            });
        }
    }
    if !commit.page_digests.is_empty() && landed.pages != commit.page_digests {
        // Buffer digests agree but page digests do not: the commit is inconsistent.
        return Err(FailureReason::ProtocolViolation {
            detail: "page digests disagree with matching buffer digests".into(),
        });
    }
    if landed.aux != commit.aux_digest {
        return Err(FailureReason::AuxMismatch);
    }
    Ok(())
}
