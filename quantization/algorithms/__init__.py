"""Post-training algorithms on a prepared model: SmoothQuant, bias correction, BatchNorm folding,
GPTQ, AWQ, the int8 KV cache, per-layer sensitivity and accuracy control, and the layer-by-layer
(sequential) calibration of decoder LLMs they run in."""
