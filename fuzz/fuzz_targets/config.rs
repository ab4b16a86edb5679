#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| lastgasp::fuzzing::config(data));
