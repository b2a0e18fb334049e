"""The ground floor every package may use: errors, registries, the modifier base and its order rules,
target patterns, batching, io, precision, metrics, model size counting, MoE unpacking and the tracer base.

Nothing here imports anything above it (quantization/, pruning/, distillation/, export/ or compress's
top: recipe, runner, session, CLI, report); tests/test_layering.py holds that line.
"""
