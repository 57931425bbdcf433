//! The receiver (decode) role: its driver, the one loop that runs a receiver session over a
//! transport (reservations, landing and coverage, fences, verification against the memory
//! that landed), and the record of what landed. Its engine handle is
//! [`ReceiverConn`](crate::engine::ReceiverConn).

mod driver;
mod landing;

pub use driver::{
    ReceiveError, ReceiveOutcome, ReceiverDriver, ReceiverDriverStats, ReserveParams, VerifiedKv,
};
