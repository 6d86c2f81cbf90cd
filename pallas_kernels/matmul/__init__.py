"""Weight products: cpu.py + cpu.cc, bfloat16 on the CPU's AMX tiles through the XLA FFI (the reference is
XLA's dot with float32 accumulation)."""
