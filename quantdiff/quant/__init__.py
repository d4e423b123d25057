"""Quantization: pure numerics, configs and sites applied to models, packing, export and quantized-checkpoint loading."""
