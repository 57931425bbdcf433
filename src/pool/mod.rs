//! pool (in progress)
