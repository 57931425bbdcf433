//! Helpers shared by the CLI's tests, which run `kvwire` processes.
#![allow(dead_code)]

pub mod process;
