"""The prompt and the leaders' --prefill-chunk that the tensor-parallel service tests share."""

from __future__ import annotations

PROMPT = "The tensor-parallel pair decodes in lockstep; every gate is a sum."
CHUNK = 16
