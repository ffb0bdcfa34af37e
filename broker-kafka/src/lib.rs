#![doc = include_str!("../README.md")]
