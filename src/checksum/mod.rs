//! checksum (in progress)
