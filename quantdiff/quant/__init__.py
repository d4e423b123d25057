"""Quantization: pure numerics, the name registry, configs and sites applied to models, packing, export and
quantized-checkpoint loading."""
