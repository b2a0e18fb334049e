"""LLM formats: the KV-cache generation ONNX (onnx, decoder, attention, MatMulNBits, W8A8, its ORT
run), the recipe's generation export, the ORT GenAI / Optimum folder files, GGUF files and
compressed-tensors checkpoints."""
