#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| lastgasp::fuzzing::kernel_record(data));
