"""Adapters that put ``ExpertLayer`` into models from other libraries.

- :mod:`kosmos_moe.integrations.transformers`: Hugging Face transformers models
  (``Qwen3MoeSparseMoeBlock``, ``DeepseekV3MoE``); ``swap_moe_blocks(model, ...)``.

Each adapter imports its library only when used, so importing this package needs none of them.
"""
