"""The typed settings of export and validation (the recipe's ``export:`` and ``validate:`` sections).

They live here, not in the recipe module, so that export/ is usable without the recipe machinery:
``compress.recipe`` embeds these classes, export/ never imports the recipe.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Strict(BaseModel):
    # the same rules as every recipe section: unknown keys are errors, no inf/nan numbers
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), allow_inf_nan=False)


class ExportSpec(_Strict):
    """ONNX export of the final model (QDQ int8 when it is quantized) and of the fp32 baseline."""

    enabled: bool = True
    opset: int | None = Field(None, ge=13)
    dynamic_batch: bool = True
    fp16: bool = False
    simplify: bool = True
    activation_dtype: Literal["uint8", "int8"] = "uint8"
    reduce_range: bool = False
    baseline: bool = True
    triton_repository: bool = False
    #: decoder LLMs: the ONNX that generates with a KV cache (int4 MatMulNBits / W8A8 / fp32 weights,
    #: export.llm.generation) instead of the single-pass graph; validated as greedy generation
    generation: bool = False
    #: MatMulNBits' accuracy_level for int4 generation files: 4 (default) lets ORT's CPU kernel quantize
    #: activations to int8 per block (faster decode, as llama.cpp's Q4_0), 0 computes in float32 (the
    #: fake-quant model's numbers)
    accuracy_level: int = Field(4, ge=0, le=4)
    #: int4 generation files: a float lm_head written as 8-bit MatMulNBits (llama.cpp's Q8_0 default for
    #: a tied embedding of SmolLM2's width; faster decode), or kept float; auto: int8 at accuracy_level 4
    lm_head: Literal["auto", "int8", "float"] = "auto"
    #: generation files' logits output: every position (perplexity, Optimum's forward) or the last only
    #: (what generation reads; skips the lm_head over the rest of the prompt, as llama.cpp does)
    logits: Literal["all", "last"] = "all"
    #: generation files' attention: ORT's fused RotaryEmbedding + GroupQueryAttention, plain ONNX ops,
    #: or (auto) fused where the installed onnxruntime has the inputs it needs
    attention: Literal["auto", "fused", "decomposed"] = "auto"
    #: transformers causal LMs: also write the compressed-tensors checkpoint (what vLLM and transformers
    #: load: int4 pack-quantized, W8A8, FP8, NVFP4, MXFP4), with the tokenizer, to export/compressed-tensors/
    compressed_tensors: bool = False
    #: the ONNX files (single-pass or generation); false: the checkpoint alone (NVFP4 and MXFP4 have no ONNX form)
    onnx: bool = True

    @field_validator("opset")
    @classmethod
    def _known_opset(cls, v: int | None) -> int | None:
        # an opset the installed onnx does not know fails the export, after the training: refuse it here
        if v is not None:
            import onnx

            newest = onnx.defs.onnx_opset_version()
            if v > newest:
                raise ValueError(f"opset {v} is newer than the installed onnx {onnx.__version__} knows "
                                 f"(at most {newest})")
        return v

    @model_validator(mode="after")
    def _generation_formats(self) -> ExportSpec:
        if self.generation and (self.fp16 or self.triton_repository):
            raise ValueError("generation files are int4/int8/fp32 ONNX Runtime models: "
                             "fp16 and triton_repository do not apply to them")
        if self.enabled and not self.onnx and not self.compressed_tensors:
            raise ValueError("onnx: false with compressed_tensors: false writes nothing; set enabled: false")
        if self.generation and not self.onnx:
            raise ValueError("generation files are ONNX: generation: true needs onnx: true")
        return self


class Thresholds(_Strict):
    """Limits checked after validation; a miss makes ``compress apply`` exit 3."""

    max_accuracy_drop: float | None = Field(None, ge=0)
    min_speedup: float | None = Field(None, gt=0)
    min_top1_agreement: float | None = Field(None, ge=0, le=1)
    min_cosine: float | None = Field(None, ge=-1, le=1)
    max_size_ratio: float | None = Field(None, gt=0)


Runtime = Literal["onnxruntime", "openvino", "cuda"]


class ValidateSpec(_Strict):
    """Runtimes to validate the exported model on and how to time it."""

    enabled: bool = True
    runtimes: list[Runtime] = Field(default_factory=lambda: list[Runtime](["onnxruntime"]))
    #: latency is timed at each of these batch sizes (each >= 1; empty: no latency timing)
    batch_sizes: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [1, 32])
    warmup: int = Field(5, ge=0)
    runs: int = Field(20, ge=1)
    threads: int | None = Field(None, ge=1)
    #: greedy tokens generated per prompt when validating generation files (export.llm.generation)
    generate_tokens: int = Field(32, ge=1)
    eval_samples: int | None = Field(None, ge=1)
    thresholds: Thresholds = Field(default_factory=Thresholds)
