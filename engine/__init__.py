"""Engine adapters, one per engine kind, behind :class:`engine.base.EngineAdapter`.

The sidecar never imports an engine kind by name: it asks :func:`build_adapters` for the
adapters its config declares, through the :data:`ADAPTERS` registry.
"""

from __future__ import annotations

from collections.abc import Mapping

from engine.base import AbortCall, EngineAdapter, Kept, Unabortable
from engine.openai import OpenAIAdapter
from engine.sglang import SGLangAdapter
from engine.vllm import VLLMAdapter
from sidecar.config import EngineKind, EngineSettings

ADAPTERS: Mapping[EngineKind, type[EngineAdapter]] = {
    EngineKind.VLLM: VLLMAdapter,
    EngineKind.OPENAI: OpenAIAdapter,
    EngineKind.SGLANG: SGLangAdapter,
}


def build_adapters(engines: Mapping[str, EngineSettings]) -> dict[str, EngineAdapter]:
    """One adapter per configured engine, keyed by the engine's config name."""
    return {name: ADAPTERS[s.kind](name, s) for name, s in engines.items()}


__all__ = ["ADAPTERS", "AbortCall", "EngineAdapter", "Kept", "Unabortable", "build_adapters"]
