"""Quantization numerics: specs, the arithmetic (qparams, fake-quant, STE, LSQ), observers, the
FakeQuantizer module, quantized layers that own their weight quantizers, and calibration."""
