"""kvrelay: KV-cache-aware routing for multi-turn traffic on P/D disaggregated vLLM."""

__version__ = "0.1.0"
