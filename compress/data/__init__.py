"""Data sources (``digits``, ``synthetic``, ``text``, ``text_lm``, ``pkg.module:factory``) and ``build_data``."""

from __future__ import annotations

from compress.data.build import SOURCES, build_data, source_kwargs
from compress.data.bundle import DataBundle, Splits, collate_unlabelled, stratified_indices

__all__ = [
    "SOURCES",
    "DataBundle",
    "Splits",
    "build_data",
    "collate_unlabelled",
    "source_kwargs",
    "stratified_indices",
]
