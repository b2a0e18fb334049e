"""Where activation quantizers go: the torch-function trace of a real forward pass, the runtimes'
rule tables, placement on the traced graph, the mode that applies a placement while the model runs,
attention written out in tensor ops, and the measured speed check."""
