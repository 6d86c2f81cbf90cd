"""Pure model functions: the decoder, its layers, MoE, quantized products, reading HF configs."""
