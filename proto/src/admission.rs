//! Admission: the only way a request reaches the transfer stage (SPEC.md §5.1).
//!
//! [`AdmissionPolicy::admit`] returns either an [`Admitted`] — a value no other code can
//! make — or a [`Rejected`] carrying the original error. The sender session accepts only
//! `Admitted` for transfer, so sending data for a request that was not admitted does not
//! compile:
//!
//! ```compile_fail
//! use kvwire_proto::admission::Admitted;
//! use kvwire_proto::wire::TransferId;
//! // There is no public constructor: the fields are private.
//! let forged = Admitted { transfer_id: TransferId(1), tokens: 1, pages: 1 };
//! ```
//!
//! A rejected request is retired with [`crate::sender::SenderSession::retire`]: a
//! reservation that arrives for it is answered with REJECT carrying the original error, and
//! no bootstrap, allocation or data follows.

use crate::wire::TransferId;
use core::fmt;

use crate::wire::ErrorCode;

/// The limits admission enforces, taken from the running engine (the pool as built, not
/// the configured numbers). `tokens_per_page` MUST be the connection layout's (SPEC.md
/// §5.1): [`crate::sender::SenderSession::submit`] refuses an [`Admitted`] whose page count
/// disagrees with the layout (`0` is read as 1, and is refused there unless the layout has
/// one token per page).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdmissionPolicy {
    /// Tokens per page.
    pub tokens_per_page: u32,
    /// Pages in the sender's pool, in total.
    pub pool_pages: u32,
    /// The maximum context length the engine serves.
    pub max_context_tokens: u64,
}

/// A request as the engine submits it for admission.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    /// The transfer id both engines know (the request id).
    pub transfer_id: TransferId,
    /// Prompt tokens whose KV pages will be transferred.
    pub tokens: u64,
}

/// Why admission refused a request.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum AdmissionError {
    /// No tokens.
    Empty,
    /// Longer than the maximum context length.
    ExceedsContext {
        /// Tokens requested.
        tokens: u64,
        /// The maximum context length.
        max_context_tokens: u64,
    },
    /// Needs more pages than the pool holds in total: it can never be served.
    ExceedsPool {
        /// Tokens requested.
        tokens: u64,
        /// Pages those tokens need.
        pages_needed: u64,
        /// Pages in the pool.
        pool_pages: u32,
        /// Tokens the pool holds.
        pool_tokens: u64,
    },
    /// Fits the pool but not the wire: more than `2^32 − 1` tokens or more than
    /// [`MAX_PAGES`](crate::wire::MAX_PAGES) pages, which no RESERVE can carry (SPEC.md
    /// §5.1). Carried as `PROMPT_EXCEEDS_POOL`, the code for "can never be served".
    ExceedsWire {
        /// Tokens requested.
        tokens: u64,
        /// Pages those tokens need.
        pages_needed: u64,
    },
}

impl AdmissionError {
    /// The wire code carried by REJECT.
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::Empty => ErrorCode::EMPTY_REQUEST,
            Self::ExceedsContext { .. } => ErrorCode::PROMPT_EXCEEDS_CONTEXT,
            Self::ExceedsPool { .. } | Self::ExceedsWire { .. } => ErrorCode::PROMPT_EXCEEDS_POOL,
        }
    }
}

impl fmt::Display for AdmissionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Empty => write!(f, "request has no tokens"),
            Self::ExceedsContext {
                tokens,
                max_context_tokens,
            } => write!(
                f,
                "prompt of {tokens} tokens exceeds the maximum context length of {max_context_tokens} tokens"
            ),
            Self::ExceedsPool {
                tokens,
                pages_needed,
                pool_pages,
                pool_tokens,
            } => write!(
                f,
                "prompt of {tokens} tokens needs {pages_needed} pages but the KV pool has {pool_pages} pages ({pool_tokens} tokens)"
            ),
            Self::ExceedsWire {
                tokens,
                pages_needed,
            } => write!(
                f,
                "prompt of {tokens} tokens ({pages_needed} pages) exceeds the wire's limits of {} tokens and {} pages per transfer",
                u32::MAX,
                crate::wire::MAX_PAGES
            ),
        }
    }
}

impl std::error::Error for AdmissionError {}

/// A request that passed admission. Only [`AdmissionPolicy::admit`] makes one.
#[derive(Debug, PartialEq, Eq)]
pub struct Admitted {
    transfer_id: TransferId,
    tokens: u32,
    pages: u32,
}

impl Admitted {
    /// The transfer id.
    pub fn transfer_id(&self) -> TransferId {
        self.transfer_id
    }
    /// Tokens.
    pub fn tokens(&self) -> u32 {
        self.tokens
    }
    /// Pages the tokens occupy; the engine allocates exactly this many source pages.
    pub fn pages(&self) -> u32 {
        self.pages
    }

    /// A copy for a cloned session (model checking). Deliberately not `Clone`: outside this
    /// crate only admission makes an `Admitted`, and submitting one consumes it.
    pub(crate) fn duplicate(&self) -> Self {
        Self {
            transfer_id: self.transfer_id,
            tokens: self.tokens,
            pages: self.pages,
        }
    }
}

/// A request admission refused, with its original error. Retire it with
/// [`crate::sender::SenderSession::retire`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[must_use = "a rejected request must be retired so a reservation for it is answered with its error"]
pub struct Rejected {
    /// The transfer id.
    pub transfer_id: TransferId,
    /// Why.
    pub error: AdmissionError,
}

impl AdmissionPolicy {
    /// Admits or rejects a request. Pure: allocates nothing, sends nothing.
    pub fn admit(&self, req: Request) -> Result<Admitted, Rejected> {
        let reject = |error| {
            Err(Rejected {
                transfer_id: req.transfer_id,
                error,
            })
        };
        if req.tokens == 0 {
            return reject(AdmissionError::Empty);
        }
        if req.tokens > self.max_context_tokens {
            return reject(AdmissionError::ExceedsContext {
                tokens: req.tokens,
                max_context_tokens: self.max_context_tokens,
            });
        }
        let tpp = u64::from(self.tokens_per_page.max(1));
        let pages_needed = req.tokens.div_ceil(tpp);
        let fits_wire =
            u32::try_from(req.tokens).is_ok() && pages_needed <= crate::wire::MAX_PAGES as u64;
        if pages_needed > u64::from(self.pool_pages) {
            return reject(AdmissionError::ExceedsPool {
                tokens: req.tokens,
                pages_needed,
                pool_pages: self.pool_pages,
                pool_tokens: u64::from(self.pool_pages) * tpp,
            });
        }
        if !fits_wire {
            return reject(AdmissionError::ExceedsWire {
                tokens: req.tokens,
                pages_needed,
            });
        }
        Ok(Admitted {
            transfer_id: req.transfer_id,
            tokens: req.tokens as u32,
            pages: pages_needed as u32,
        })
    }
}
