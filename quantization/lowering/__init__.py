"""From a calibrated fake-quant model to real integer compute: conversion to int8 / int4 modules and
the Triton kernels they run (CUDA, or CPU under ``TRITON_INTERPRET=1``)."""
