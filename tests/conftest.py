"""Shared test support. Its presence puts `tests/` on `sys.path` (pytest's rootdir-relative
"prepend" import mode), so every test folder can import `strict_device`, the CPU-emulated
accelerator that fails on any CPU tensor mixed into a device table, as CUDA does."""
