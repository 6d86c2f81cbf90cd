"""Weight products on the CPU through the XLA FFI: cpu.py + cpu.cc, bfloat16 on AMX tiles (the reference is
XLA's dot with float32 accumulation); cpu_quant.py + cpu_quant.cc, int8 / int4 weights (grouped scales, an
optional minimum: int8 / int4 quantization and the GGUF types) times activations quantized to int8 or int16
codes (the reference is the float product of those activations with the dequantized weights)."""
