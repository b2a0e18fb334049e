"""QDQ int8 export: fake-quantizers swapped for ONNX Q/DQ ops (swap), and the graph passes (graph runs
them over the ir view) that make ONNX Runtime fuse the file into integer kernels."""
