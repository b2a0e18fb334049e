"""Exported files in real runtimes: the runtime registry (onnxruntime, openvino), the CUDA int8
kernels, streaming parity, what a file holds (describe) and the measurements (parity, accuracy,
latency, size) with their thresholds."""
