"""Weight sparsity inside the Linears of a decoder LLM, unstructured or N:M (2:4, 4:8).

- ``pruning.sparse.params``: the settings (:class:`SparsityParams`; SparseGPT's and Wanda's classes
  derive from it) and the selection of the decoder layers' Linears;
- ``pruning.sparse.sparsegpt``: SparseGPT (Frantar & Alistarh, 2023), optimal-brain-surgeon pruning
  with the Hessians GPTQ accumulates (compress.quantization.algorithms.gptq), optionally quantizing
  in the same sweep;
- ``pruning.sparse.wanda``: Wanda (Sun et al., 2023), ``|W| * ||X||`` per output row, no update;
- ``pruning.sparse.modifiers``: the ``sparsegpt`` and ``wanda`` recipe modifiers.

Both run layer by layer on the sequential pipeline (compress.quantization.algorithms.sequential) and
leave a mask on every pruned Linear (compress.core.sparsity), which later stages keep.
"""
