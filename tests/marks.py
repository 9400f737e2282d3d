"""Marks shared by the Triton kernel tests: without CUDA, kernels run in Triton's CPU interpreter
(tests/conftest.py sets TRITON_INTERPRET=1 before any kernel is defined)."""

import os

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreter = pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need Triton's interpreter (TRITON_INTERPRET=1)")
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA")
